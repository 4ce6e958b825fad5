"""The gateway's TLS and HTTP interception on loopback: a sandbox CA, mitmproxy, a real
TLS upstream that echoes what it was sent, and secrets that must land only there."""

from __future__ import annotations

import asyncio
import base64
import datetime
import re
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from space.node.api import EgressEvent, SecretGrant
from space.node.egress.intercept import Exchange, Interceptor, load_ca
from space.node.egress.sniff import sniff
from space.node.network.ca import certificate_pem, ensure_ca

VALUE = "sk-live-0123456789abcdef"
PLACEHOLDER = "space_ph_" + "a" * 32


def _upstream_cert(directory: Path) -> tuple[Path, Path]:
    """A CA and a leaf for allowed.test under it; returns (ca file, leaf key+cert file)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "upstream test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "allowed.test")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("allowed.test")]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, leaf_file = directory / "upstream-ca.pem", directory / "leaf.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    leaf_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        + leaf.public_bytes(serialization.Encoding.PEM)
    )
    return ca_file, leaf_file


class World:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.upstream_ca, self.leaf = _upstream_cert(tmp)
        self.sandbox_ca = ensure_ca(tmp / "ca", "sb-1")
        (tmp / "guest-ca.pem").write_bytes(certificate_pem(self.sandbox_ca))
        self.seen: list[bytes] = []
        self.events: list[EgressEvent] = []
        self.grants: list[SecretGrant] = []
        self.name = "allowed.test"

    async def upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answers every request of a keep-alive connection, echoing its head."""
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                chunk = await reader.read(4096)
                if not chunk:
                    writer.close()
                    return
                buffer += chunk
            head, buffer = buffer.split(b"\r\n\r\n", 1)
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            while length and len(buffer) < int(length[1]):
                buffer += await reader.read(4096)
            size = int(length[1]) if length else 0
            self.seen.append(head + b"\r\n\r\n" + buffer[:size])
            buffer = buffer[size:]
            body = b"you sent:\n" + head
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n" % len(body))
            writer.write(b"X-Echo: " + head.split(b"\r\n")[1] + b"\r\n\r\n" + body)
            await writer.drain()


async def _scenario(
    tmp: Path, grants: list[SecretGrant], talk: Callable[[World, int], Awaitable[bytes]]
) -> tuple[World, bytes]:
    world = World(tmp)
    world.grants = grants
    upstream_ssl = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    upstream_ssl.load_cert_chain(world.leaf)
    upstream = await asyncio.start_server(world.upstream, "127.0.0.1", 0, ssl=upstream_ssl)
    upstream_port = upstream.sockets[0].getsockname()[1]
    interceptor = Interceptor(tmp / "mitm", world.upstream_ca)
    ca = load_ca(world.sandbox_ca.read_bytes(), interceptor.dhparam)

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.read(65536)
        assert sniff(first) is not None
        exchange = Exchange(
            sandbox_id="sb-1",
            name=world.name,
            address="127.0.0.1",
            port=upstream_port,
            grants=lambda: world.grants,
            audit=world.events.append,
            ca=ca,
        )
        await interceptor.handle(exchange, first, reader, writer, ("198.18.0.2", 443))

    gateway = await asyncio.start_server(accepted, "127.0.0.1", 0)
    port = gateway.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(20):
            answer = await talk(world, port)
    finally:
        gateway.close()
        upstream.close()
    return world, answer


async def _https(
    world: World,
    port: int,
    host: str = "allowed.test",
    sni: str = "allowed.test",
    headers: str = "",
) -> bytes:
    context = ssl.create_default_context(cafile=str(world.tmp / "guest-ca.pem"))
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=sni
    )
    writer.write(f"GET /x HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


def _grant(**overrides: object) -> SecretGrant:
    fields: dict[str, object] = {
        "name": "API_KEY",
        "value": VALUE,
        "placeholder": PLACEHOLDER,
        "hosts": ("allowed.test",),
    }
    fields.update(overrides)
    return SecretGrant(**fields)  # type: ignore[arg-type]


def test_a_placeholder_is_swapped_for_its_secret_only_upstream_and_scrubbed_on_return(
    tmp_path: Path,
) -> None:
    world, answer = asyncio.run(
        _scenario(
            tmp_path,
            [_grant()],
            lambda w, p: _https(w, p, headers=f"Authorization: Bearer {PLACEHOLDER}\r\n"),
        )
    )
    assert answer.startswith(b"HTTP/1.1 200")
    assert f"Bearer {VALUE}".encode() in world.seen[0]
    assert VALUE.encode() not in answer, "the echoed secret must be scrubbed"
    assert PLACEHOLDER.encode() in answer
    used = [e for e in world.events if e.secrets]
    assert used and used[0].secrets == ("API_KEY",) and used[0].decision == "allow"


def test_a_header_secret_is_set_on_requests_to_its_host(tmp_path: Path) -> None:
    grant = _grant(injection="header", header="X-Api-Key", format="key={value}")
    world, answer = asyncio.run(_scenario(tmp_path, [grant], lambda w, p: _https(w, p)))
    assert answer.startswith(b"HTTP/1.1 200")
    assert f"X-Api-Key: key={VALUE}".encode() in world.seen[0]


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_a_placeholder_inside_basic_credentials_is_swapped_as_git_sends_a_token(
    tmp_path: Path,
) -> None:
    header = f"Authorization: {_basic('x-access-token', PLACEHOLDER)}\r\n"
    world, answer = asyncio.run(
        _scenario(tmp_path, [_grant()], lambda w, p: _https(w, p, headers=header))
    )
    assert answer.startswith(b"HTTP/1.1 200")
    assert _basic("x-access-token", VALUE).encode() in world.seen[0]
    assert PLACEHOLDER.encode() not in world.seen[0]
    assert [e.secrets for e in world.events] == [("API_KEY",)]


def test_a_placeholder_in_repeated_headers_is_swapped_in_each(tmp_path: Path) -> None:
    headers = f"X-Token: a-{PLACEHOLDER}\r\nX-Token: b-{PLACEHOLDER}\r\n"
    world, _ = asyncio.run(
        _scenario(tmp_path, [_grant()], lambda w, p: _https(w, p, headers=headers))
    )
    assert f"X-Token: a-{VALUE}\r\nX-Token: b-{VALUE}".encode() in world.seen[0]


@pytest.mark.parametrize(
    "value",
    [
        "Basic not*base64!",  # not base64: sent as it is
        "Bearer " + base64.b64encode(b"u:" + PLACEHOLDER.encode()).decode(),  # not Basic
        _basic("user", "no-placeholder-here"),
    ],
)
def test_negative_authorization_without_a_basic_placeholder_is_sent_untouched(
    tmp_path: Path, value: str
) -> None:
    header = f"Authorization: {value}\r\n"
    world, _ = asyncio.run(
        _scenario(tmp_path, [_grant()], lambda w, p: _https(w, p, headers=header))
    )
    assert header.encode() in world.seen[0]
    assert VALUE.encode() not in world.seen[0]
    assert all(not e.secrets for e in world.events)


def test_negative_basic_credentials_to_an_unbound_host_keep_the_placeholder(
    tmp_path: Path,
) -> None:
    header = f"Authorization: {_basic('x-access-token', PLACEHOLDER)}\r\n"
    grant = _grant(hosts=("api.elsewhere.test",))
    world, _ = asyncio.run(_scenario(tmp_path, [grant], lambda w, p: _https(w, p, headers=header)))
    assert header.encode() in world.seen[0]


def test_negative_a_placeholder_in_a_request_body_is_not_swapped(tmp_path: Path) -> None:
    """A body is often stored by the bound host (an issue, a gist): no value goes there."""

    async def post(world: World, port: int) -> bytes:
        context = ssl.create_default_context(cafile=str(world.tmp / "guest-ca.pem"))
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="allowed.test"
        )
        body = f'{{"key": "{PLACEHOLDER}"}}'.encode()
        head = f"POST /x HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: {len(body)}\r\n"
        writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
        await writer.drain()
        data = await reader.read()
        writer.close()
        return data

    world, answer = asyncio.run(_scenario(tmp_path, [_grant()], post))
    assert answer.startswith(b"HTTP/1.1 200")
    assert world.seen[0].endswith(f'{{"key": "{PLACEHOLDER}"}}'.encode())
    assert all(not e.secrets for e in world.events)


def test_negative_a_placeholder_bound_to_another_host_goes_out_unreplaced(
    tmp_path: Path,
) -> None:
    grant = _grant(hosts=("api.elsewhere.test",))
    world, _ = asyncio.run(
        _scenario(
            tmp_path,
            [grant],
            lambda w, p: _https(w, p, headers=f"Authorization: Bearer {PLACEHOLDER}\r\n"),
        )
    )
    assert PLACEHOLDER.encode() in world.seen[0]
    assert VALUE.encode() not in world.seen[0]


def test_negative_a_request_whose_host_is_not_the_sni_is_refused_before_upstream(
    tmp_path: Path,
) -> None:
    world, answer = asyncio.run(
        _scenario(tmp_path, [_grant()], lambda w, p: _https(w, p, host="evil.test"))
    )
    assert answer.startswith(b"HTTP/1.1 421")
    assert not world.seen
    assert any(e.decision == "deny" and "evil.test" in e.reason for e in world.events)


def test_negative_an_upstream_the_node_does_not_trust_is_not_talked_to(tmp_path: Path) -> None:
    async def talk(world: World, port: int) -> bytes:
        return await _https(world, port)

    async def scenario() -> tuple[World, bytes]:
        return await _scenario(tmp_path, [_grant()], talk)

    # The same world, but the interceptor trusts nothing of the upstream's.
    original = Interceptor.__init__

    def untrusting(self: Interceptor, confdir: Path, upstream_ca: Path | None) -> None:
        original(self, confdir, tmp_path / "empty-ca.pem")

    (tmp_path / "empty-ca.pem").write_bytes(certificate_pem(ensure_ca(tmp_path / "x", "other")))
    mp = pytest.MonkeyPatch()
    mp.setattr(Interceptor, "__init__", untrusting)
    try:
        world, answer = asyncio.run(scenario())
    finally:
        mp.undo()
    assert not answer.startswith(b"HTTP/1.1 200")
    assert all(VALUE.encode() not in seen for seen in world.seen)


def test_negative_a_second_request_on_the_connection_for_another_host_is_refused(
    tmp_path: Path,
) -> None:
    async def pipelined(world: World, port: int) -> bytes:
        context = ssl.create_default_context(cafile=str(world.tmp / "guest-ca.pem"))
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="allowed.test"
        )
        writer.write(
            b"GET /1 HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
            b"GET /2 HTTP/1.1\r\nHost: evil.test\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        data = await reader.read()
        writer.close()
        return data

    world, answer = asyncio.run(_scenario(tmp_path, [_grant()], pipelined))
    assert answer.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 421" in answer
    assert len(world.seen) == 1 and b"evil.test" not in world.seen[0]
