"""Port exposure on real VMs (issue 20): servers listening in a sandbox reached from the
host through the control plane (`space serve --sandbox-domain`), over HTTP and
WebSocket, by Host ``<port>-<id>.<domain>`` against 127.0.0.1 (no DNS) and by the
``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers; tokens, ports off, a paused sandbox
woken by a request, a large answer whole; and the latency of a request through the
tunnel beside an exec's."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from space import Sandbox
from space.node.api.websocket_client import StreamPipe, WebSocketClient, WebSocketError

from .platform import Platform, running_platform

pytestmark = pytest.mark.vm

DOMAIN = "ports.test"
HTTP_PORT = 8000
WS_PORT = 8765
_BIG = 4 * 1024 * 1024 + 3

#: A WebSocket echo server on the guest's stdlib (RFC 6455, unfragmented frames).
_WS_ECHO = r"""
import asyncio, base64, hashlib, struct, sys

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def frame(op, data):
    n = len(data)
    if n < 126:
        head = bytes([0x80 | op, n])
    elif n < 65536:
        head = bytes([0x80 | op, 126]) + struct.pack(">H", n)
    else:
        head = bytes([0x80 | op, 127]) + struct.pack(">Q", n)
    return head + data


async def handle(reader, writer):
    head = await reader.readuntil(b"\r\n\r\n")
    keys = [line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
            if line.lower().startswith(b"sec-websocket-key:")]
    if not keys:
        writer.write(b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: 0\r\n\r\n")
        writer.close()
        return
    key = keys[0]
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                 b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    while True:
        b0, b1 = await reader.readexactly(2)
        op, n = b0 & 0x0F, b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack(">H", await reader.readexactly(2))
        elif n == 127:
            (n,) = struct.unpack(">Q", await reader.readexactly(8))
        mask = await reader.readexactly(4) if b1 & 0x80 else bytes(4)
        raw = await reader.readexactly(n)
        data = bytes(c ^ mask[i % 4] for i, c in enumerate(raw))
        if op == 8:
            writer.write(frame(8, data[:2]))
            await writer.drain()
            break
        if op in (1, 2):
            writer.write(frame(op, data))
            await writer.drain()
    writer.close()


async def main():
    server = await asyncio.start_server(handle, "0.0.0.0", int(sys.argv[1]))
    async with server:
        await server.serve_forever()


asyncio.run(main())
"""


@dataclass
class Site:
    platform: Platform
    key: str
    sandbox: Sandbox

    def host(self, port: int) -> str:
        return self.sandbox.get_host(port)

    def get(
        self, path: str, headers: dict[str, str] | None = None, port: int = HTTP_PORT
    ) -> httpx.Response:
        headers = {"Host": self.host(port), **(headers or {})}
        return httpx.get(f"{self.platform.url}{path}", headers=headers, timeout=120)

    def token(self) -> dict[str, str]:
        token = self.sandbox.traffic_token
        assert token is not None
        return {"X-Space-Traffic-Token": token}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    data_dir = tmp_path_factory.mktemp("ports")
    with running_platform(data_dir, ["--sandbox-domain", DOMAIN]) as platform:
        key = platform.create_key("ports")
        sandbox = Sandbox.create(api_url=platform.url, api_key=key, expose_ports=True)
        try:
            sandbox.files.write(
                "/home/user/www/big.bin", bytes(range(256)) * (_BIG // 256) + b"end"
            )
            sandbox.files.write("/home/user/www/hello.txt", "hello from the guest\n")
            sandbox.files.write("/home/user/ws_echo.py", _WS_ECHO)
            www = "/home/user/www"
            sandbox.commands.run(
                f"python3 -m http.server {HTTP_PORT} --bind 127.0.0.1 --directory {www}",
                background=True,
                timeout_s=None,
            )
            echo = f"python3 /home/user/ws_echo.py {WS_PORT}"
            sandbox.commands.run(echo, background=True, timeout_s=None)
            site = Site(platform, key, sandbox)
            _wait_listening(site, HTTP_PORT)
            _wait_listening(site, WS_PORT)
            yield site
        finally:
            sandbox.kill()
            sandbox.close()


def _wait_listening(site: Site, port: int) -> None:
    deadline = time.monotonic() + 60
    while "nothing listens" in site.get("/hello.txt", site.token(), port).text:
        assert time.monotonic() < deadline, f"nothing listens on {port} in the guest"
        time.sleep(0.5)


def test_http_by_host_and_by_headers_reaches_the_guest_server(site: Site) -> None:
    answer = site.get("/hello.txt", site.token())
    assert answer.status_code == 200 and answer.text == "hello from the guest\n", answer.text
    by_headers = httpx.get(
        f"{site.platform.url}/hello.txt?x=1",
        headers={
            "E2b-Sandbox-Id": site.sandbox.sandbox_id,
            "E2b-Sandbox-Port": str(HTTP_PORT),
            "e2b-traffic-access-token": site.token()["X-Space-Traffic-Token"],
        },
        timeout=60,
    )
    assert by_headers.status_code == 200 and by_headers.text == "hello from the guest\n"
    missing = site.get("/nope", site.token())
    assert missing.status_code == 404  # the guest server's own answer


def test_a_large_answer_arrives_whole(site: Site) -> None:
    started = time.monotonic()
    answer = site.get("/big.bin", site.token())
    elapsed = time.monotonic() - started
    assert answer.status_code == 200
    assert answer.content == bytes(range(256)) * (_BIG // 256) + b"end"
    print(f"\n{len(answer.content) / 2**20:.1f} MiB through the tunnel in {elapsed:.2f} s")


def test_a_websocket_echoes_through_the_tunnel(site: Site) -> None:
    async def session() -> list[bytes | str | None]:
        reader, writer = await asyncio.open_connection("127.0.0.1", site.platform.port)
        client = WebSocketClient(StreamPipe(reader, writer))
        token = site.token()["X-Space-Traffic-Token"].encode()
        await client.handshake(site.host(WS_PORT), "/", [(b"e2b-traffic-access-token", token)])
        got: list[bytes | str | None] = []
        for message in ("hello", b"\x00\x01binary", "x" * 200_000):
            await client.send(message)
            got.append(await client.receive())
        await client.close()
        return got

    got = asyncio.run(asyncio.wait_for(session(), 120))
    assert got == ["hello", b"\x00\x01binary", "x" * 200_000]


def test_negative_wrong_or_missing_tokens_are_401_and_ports_off_403(site: Site) -> None:
    assert site.get("/hello.txt").status_code == 401
    wrong = site.get("/hello.txt", {"X-Space-Traffic-Token": "not-the-token"})
    assert wrong.status_code == 401
    assert wrong.json()["message"] == "missing or wrong access token for this sandbox"

    async def refused_websocket() -> int | None:
        reader, writer = await asyncio.open_connection("127.0.0.1", site.platform.port)
        client = WebSocketClient(StreamPipe(reader, writer))
        try:
            await client.handshake(site.host(WS_PORT), "/")
        except WebSocketError as exc:
            return exc.status
        finally:
            await client.close()
        return None

    assert asyncio.run(refused_websocket()) == 403  # closed before it was accepted
    token = site.token()
    site.sandbox.set_ports(False)
    try:
        off = site.get("/hello.txt", token)
        assert off.status_code == 403 and "exposes no ports" in off.json()["message"]
    finally:
        site.sandbox.set_ports(True)
    assert site.get("/hello.txt", site.token()).status_code == 200


def test_a_paused_sandbox_is_resumed_by_a_request(site: Site) -> None:
    assert site.sandbox.pause().state == "paused"
    answer = site.get("/hello.txt", site.token())
    assert answer.status_code == 200 and answer.text == "hello from the guest\n"
    assert site.sandbox.get_info().state == "running"


def test_latency_of_a_request_through_the_tunnel_beside_an_exec(site: Site) -> None:
    with httpx.Client(timeout=60) as client:
        headers = {"Host": site.host(HTTP_PORT), **site.token()}
        url = f"{site.platform.url}/hello.txt"
        client.get(url, headers=headers)  # warm
        http_s = []
        for _ in range(20):
            started = time.monotonic()
            assert client.get(url, headers=headers).status_code == 200
            http_s.append(time.monotonic() - started)
    exec_s = []
    for _ in range(20):
        started = time.monotonic()
        assert site.sandbox.commands.run("true").exit_code == 0
        exec_s.append(time.monotonic() - started)
    http_ms, exec_ms = statistics.median(http_s) * 1000, statistics.median(exec_s) * 1000
    print(f"\nmedian HTTP round trip through the tunnel {http_ms:.1f} ms, exec {exec_ms:.1f} ms")
    assert http_ms < 5000
