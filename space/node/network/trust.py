"""Making a guest trust its sandbox's egress CA, through spaced (never by mounting).

The CA certificate goes where Debian's tools look: ``/usr/local/share/ca-certificates``
(kept by a later ``update-ca-certificates``), ``/etc/ssl/certs/<subject hash>.0``
(OpenSSL's directory lookup) and a marked block at the end of the bundle
``/etc/ssl/certs/ca-certificates.crt`` (read by OpenSSL, GnuTLS, Go and most else).
Tools with their own bundle are pointed at it by ``TRUST_ENV``, which every exec
starts with. Only the certificate ever enters the guest, never the key.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from space.node.channel import GuestChannel
from space.node.errors import NotFound, ResourceExhausted

__all__ = ["TRUST_ENV", "install_ca"]

CA_FILE = "/usr/local/share/ca-certificates/space-egress.crt"
BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
TRUST_ENV = {
    "REQUESTS_CA_BUNDLE": BUNDLE,
    "PIP_CERT": BUNDLE,
    "CURL_CA_BUNDLE": BUNDLE,
    "NODE_EXTRA_CA_CERTS": CA_FILE,
}
_BEGIN = b"# BEGIN SPACE egress CA\n"
_END = b"# END SPACE egress CA\n"
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


def with_block(bundle: bytes, cert_pem: bytes) -> bytes:
    """``bundle`` with its SPACE block (if any) replaced by one holding ``cert_pem``."""
    start = bundle.find(_BEGIN)
    if start >= 0:
        end = bundle.find(_END, start)
        bundle = bundle[:start] + (bundle[end + len(_END) :] if end >= 0 else b"")
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
