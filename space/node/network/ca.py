"""Each sandbox's own certificate authority, for the egress gateway's TLS termination.

The guest trusts exactly one CA of ours: its sandbox's. A leaf the gateway issues for
one sandbox is worthless in any other, and the CA's key never leaves the node (it is
kept in ``data_dir/egress/ca``, readable by root only). ECDSA P-256: a key and a
self-signed certificate take about a millisecond.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from OpenSSL import crypto

__all__ = ["ca_path", "certificate_pem", "ensure_ca", "remove_ca", "subject_hash"]

_VALID = datetime.timedelta(days=3650)


def ca_path(directory: Path, sandbox_id: str) -> Path:
    return directory / f"{sandbox_id}.pem"


def ensure_ca(directory: Path, sandbox_id: str) -> Path:
    """The sandbox's CA file (key and certificate, PEM), made on first use."""
    path = ca_path(directory, sandbox_id)
    if path.exists():
        return path
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "SPACE"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"SPACE egress CA {sandbox_id}"[:64]),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + _VALID)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ) + cert.public_bytes(serialization.Encoding.PEM)
    temp = path.with_suffix(".tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(pem)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temp, path)
    return path


def certificate_pem(path: Path) -> bytes:
    """The CA's certificate alone (what the guest gets), PEM."""
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return cert.public_bytes(serialization.Encoding.PEM)


def subject_hash(cert_pem: bytes) -> str:
    """OpenSSL's subject hash: the file name (``<hash>.0``) OpenSSL looks a CA up by in
    a certificate directory such as /etc/ssl/certs."""
    cert = crypto.load_certificate(crypto.FILETYPE_PEM, cert_pem)
    value = cert.subject_name_hash()  # an int, whatever the stubs say
    return f"{int(value):08x}"


def remove_ca(directory: Path, sandbox_id: str) -> None:
    ca_path(directory, sandbox_id).unlink(missing_ok=True)
