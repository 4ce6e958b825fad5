"""Hostile input at the node API's edge costs nothing (issue 17), as at the control
plane's: the node token is checked before a byte of the body is read, JSON bodies are
capped before they are read whole, uploads stream past that cap, and a served node
bounds header time and size and each client's open connections."""

from __future__ import annotations

import asyncio
import contextlib
import io
import tarfile
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from space.node.api import SandboxSpec
from space.node.api.http_connections import MAX_HEADER_BYTES
from space.node.http.server import MAX_NODE_JSON_BODY_BYTES, create_node_app, node_server
from tests.ports import free_port
from tests.unit._raw_http import CHUNK_BYTES, StreamedBody, closed_by_server
from tests.unit.fakes import FakeNode

pytestmark = pytest.mark.anyio

TOKEN = "node-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def node() -> FakeNode:
    fake = FakeNode()
    await fake.create_sandbox(SandboxSpec(sandbox_id="sb-1"))
    fake.calls.clear()
    return fake


@contextlib.asynccontextmanager
async def _client(node: FakeNode) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_node_app(node, TOKEN))
    async with httpx.AsyncClient(transport=transport, base_url="http://node/node/v1") as client:
        yield client


def _error(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/sandboxes"), ("PUT", "/sandboxes/sb-1/files?path=/f"), ("POST", "/nowhere")],
)
async def test_negative_a_huge_body_without_the_token_is_refused_unread(
    node: FakeNode, headers: dict[str, str], method: str, path: str
) -> None:
    async with _client(node) as client:
        body = StreamedBody(512 << 20, fill=b"{")  # not JSON either: the token decides first
        answer = await client.request(method, path, content=body, headers=headers)
        assert answer.status_code == 401 and _error(answer)["code"] == "unauthenticated"
        assert answer.headers["connection"] == "close"
        assert body.sent == 0 and node.calls == []


async def test_negative_a_declared_json_body_over_the_cap_is_413_unread(node: FakeNode) -> None:
    async with _client(node) as client:
        content = b" " * (MAX_NODE_JSON_BODY_BYTES + 1)
        answer = await client.post("/sandboxes", content=content, headers=AUTH)
        assert answer.status_code == 413
        error = _error(answer)
        assert error["code"] == "resource_exhausted"
        assert error["details"] == {
            "limit_bytes": MAX_NODE_JSON_BODY_BYTES,
            "observed_bytes": MAX_NODE_JSON_BODY_BYTES + 1,
        }
        assert node.calls == []


async def test_negative_a_streamed_json_body_over_the_cap_is_413_read_no_further(
    node: FakeNode,
) -> None:
    async with _client(node) as client:
        body = StreamedBody(64 << 20)  # chunked: no Content-Length to refuse by
        answer = await client.post("/sandboxes/sb-1/exec", content=body, headers=AUTH)
        assert answer.status_code == 413 and answer.headers["connection"] == "close"
        assert MAX_NODE_JSON_BODY_BYTES < body.sent <= MAX_NODE_JSON_BODY_BYTES + CHUNK_BYTES
        assert node.calls == []


async def test_a_json_body_of_exactly_the_cap_is_read(node: FakeNode) -> None:
    async with _client(node) as client:
        content = b'{"sandbox_id": "sb-2"}'.ljust(MAX_NODE_JSON_BODY_BYTES, b" ")
        headers = {**AUTH, "Content-Type": "application/json"}
        answer = await client.post("/sandboxes", content=content, headers=headers)
        assert answer.status_code == 201, answer.text
        assert answer.json()["sandbox_id"] == "sb-2"


async def test_a_file_upload_streams_past_the_json_cap(node: FakeNode) -> None:
    async with _client(node) as client:
        body = StreamedBody(2 * MAX_NODE_JSON_BODY_BYTES, fill=b"x")
        answer = await client.put(
            "/sandboxes/sb-1/files", params={"path": "/tmp/f"}, content=body, headers=AUTH
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["size"] == 2 * MAX_NODE_JSON_BODY_BYTES
        assert max(node.upload_chunk_sizes) <= CHUNK_BYTES  # handed on as it came, not buffered


async def test_a_build_context_streams_past_the_json_cap(node: FakeNode) -> None:
    async with _client(node) as client:
        content = tarred({"space.toml": b'name = "big"\nbase = "debian:bookworm"\n'})
        content += b"\0" * (2 * MAX_NODE_JSON_BODY_BYTES)  # tar's end-of-archive padding
        answer = await client.post("/templates/builds", content=content, headers=AUTH)
        assert answer.status_code == 200, answer.text
        assert ("big", "latest") in node.templates


def tarred(files: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


# -- a served node: header deadline, header size, connections per client ------------


@contextlib.asynccontextmanager
async def _serving(**bounds: Any) -> AsyncIterator[int]:
    """node_server over a FakeNode on a free loopback port; yields the port."""
    port = free_port()
    server = node_server(create_node_app(FakeNode(), TOKEN), host="127.0.0.1", port=port, **bounds)
    serving = asyncio.create_task(server.serve())
    try:
        for _ in range(250):
            if server.started or serving.done():
                break
            await asyncio.sleep(0.02)
        assert server.started, "the node API did not start"
        yield port
    finally:
        server.should_exit = True
        await serving


async def test_negative_a_request_whose_headers_never_end_is_closed() -> None:
    async with _serving(header_timeout_s=0.3) as port:
        silent = await asyncio.open_connection("127.0.0.1", port)
        trickling = await asyncio.open_connection("127.0.0.1", port)
        trickling[1].write(b"GET /node/v1/info HTTP/1.1\r\nHost: x\r\n")
        await trickling[1].drain()
        started = asyncio.get_running_loop().time()
        assert await closed_by_server(silent[0], within_s=5) == b""
        assert await closed_by_server(trickling[0], within_s=5) == b""
        assert asyncio.get_running_loop().time() - started < 3
        for _, writer in (silent, trickling):
            writer.close()


async def test_negative_headers_over_the_cap_answer_400() -> None:
    async with _serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        padding = b"X-Pad: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\n"
        writer.write(b"GET /node/v1/info HTTP/1.1\r\nHost: x\r\n" + padding + b"\r\n")
        with contextlib.suppress(ConnectionResetError):
            await writer.drain()
        assert (await closed_by_server(reader, within_s=5)).startswith(b"HTTP/1.1 400")
        writer.close()


async def test_negative_a_client_over_its_connection_cap_is_closed() -> None:
    async with _serving(max_connections_per_client=3) as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await asyncio.sleep(0.1)  # the server has taken them
        extra_reader, extra_writer = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_by_server(extra_reader, within_s=5) == b""
        extra_writer.close()
        held.pop()[1].close()
        await asyncio.sleep(0.1)  # the server has seen it go
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/node/v1/info", headers=AUTH)).status_code == 200
        for _, writer in held:
            writer.close()
