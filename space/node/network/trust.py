"""Making a guest trust its sandbox's egress CA, through spaced (never by mounting).

The CA certificate goes where Debian's tools look: ``/usr/local/share/ca-certificates``
(kept by a later ``update-ca-certificates``), ``/etc/ssl/certs/<subject hash>.0``
(OpenSSL's directory lookup) and a marked block at the end of the bundle
``/etc/ssl/certs/ca-certificates.crt`` (read by OpenSSL, GnuTLS, Go and most else).
Tools with their own bundle are pointed at it by ``TRUST_ENV``, which every exec
starts with. Only the certificate ever enters the guest, never the key.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from space.node.api import NotFound, ResourceExhausted
from space.node.channel import GuestChannel

__all__ = ["TRUST_ENV", "install_ca", "remove_ca", "without_ca"]

CA_FILE = "/usr/local/share/ca-certificates/space-egress.crt"
BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
TRUST_ENV = {
    "SSL_CERT_FILE": BUNDLE,  # OpenSSL's default anyway; read by uv and rustls-native-certs
    "REQUESTS_CA_BUNDLE": BUNDLE,
    "PIP_CERT": BUNDLE,
    "CURL_CA_BUNDLE": BUNDLE,
    "GIT_SSL_CAINFO": BUNDLE,
    "AWS_CA_BUNDLE": BUNDLE,
    "CARGO_HTTP_CAINFO": BUNDLE,
    "UV_NATIVE_TLS": "true",  # uv trusts its built-in roots only, unless told
    # The bundle, not CA_FILE: that is missing without a policy, and Node warns then.
    "NODE_EXTRA_CA_CERTS": BUNDLE,
}
_BEGIN = b"# BEGIN SPACE egress CA\n"
_END = b"# END SPACE egress CA\n"
#: Where update-ca-certificates links a CA of CA_FILE's name, if a build step ran it.
_LINKED = "/etc/ssl/certs/space-egress.pem"
#: A bigger bundle than this is not one we are willing to read back from a guest.
_MAX_BUNDLE = 8 << 20


async def install_ca(channel: GuestChannel, cert_pem: bytes, subject_hash: str) -> None:
    """Make the guest trust ``cert_pem`` (replacing any CA installed before). Raises
    the channel's errors; ResourceExhausted if the guest's bundle is implausibly big."""
    await channel.write_file(CA_FILE, _once(cert_pem), user="root", mode=0o644)
    await channel.write_file(
        f"/etc/ssl/certs/{subject_hash}.0", _once(cert_pem), user="root", mode=0o644
    )
    bundle = await _read(channel, BUNDLE)
    await channel.write_file(BUNDLE, _once(with_block(bundle, cert_pem)), user="root", mode=0o644)


async def remove_ca(channel: GuestChannel, cert_pem: bytes, subject_hash: str) -> None:
    """Undo install_ca, also where ``update-ca-certificates`` copied the CA meanwhile
    (a template build's run step may run it): a template must not keep trusting the CA
    of the VM it was built in."""
    for path in (CA_FILE, f"/etc/ssl/certs/{subject_hash}.0", _LINKED):
        with contextlib.suppress(NotFound):
            await channel.remove(path)
    bundle = await _read(channel, BUNDLE)
    cleaned = without_ca(bundle, cert_pem)
    if cleaned != bundle:
        await channel.write_file(BUNDLE, _once(cleaned), user="root", mode=0o644)


def without_ca(bundle: bytes, cert_pem: bytes) -> bytes:
    """``bundle`` without its SPACE block and without any other copy of ``cert_pem``."""
    bundle = _without_block(bundle)
    pem = cert_pem.strip()
    while pem and pem in bundle:
        start = bundle.index(pem)
        end = start + len(pem)
        if bundle[end : end + 1] == b"\n":
            end += 1
        bundle = bundle[:start] + bundle[end:]
    return bundle


def _without_block(bundle: bytes) -> bytes:
    start = bundle.find(_BEGIN)
    if start < 0:
        return bundle
    end = bundle.find(_END, start)
    return bundle[:start] + (bundle[end + len(_END) :] if end >= 0 else b"")


def with_block(bundle: bytes, cert_pem: bytes) -> bytes:
    """``bundle`` with its SPACE block (if any) replaced by one holding ``cert_pem``."""
    bundle = _without_block(bundle)
    if bundle and not bundle.endswith(b"\n"):
        bundle += b"\n"
    return bundle + _BEGIN + cert_pem + _END


async def _read(channel: GuestChannel, path: str) -> bytes:
    try:
        reader = await channel.read_file(path, user="root")
    except NotFound:
        return b""
    if reader.stat.size > _MAX_BUNDLE:
        await reader.aclose()
        raise ResourceExhausted(f"{path} in the guest is over {_MAX_BUNDLE} bytes")
    data = b""
    async for chunk in reader:
        data += chunk
        if len(data) > _MAX_BUNDLE:
            await reader.aclose()
            raise ResourceExhausted(f"{path} in the guest is over {_MAX_BUNDLE} bytes")
    return data


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data
