"""Port tunnels through the node's HTTP API (issue 20): RemoteNode.open_port over a real
uvicorn server, its WebSocket route, and the per-client connection count after upgrades."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from space.node.api import ConnectionRefused, NotFound, SandboxSpec, Unavailable
from space.node.http.client import RemoteNode
from space.node.http.server import create_node_app, node_server
from tests.unit.fakes import FakeNode
from tests.unit.test_guest_ports import echo, free_port, read_all, serving

pytestmark = pytest.mark.anyio

TOKEN = "node-token"


@contextlib.asynccontextmanager
async def served(node: FakeNode, per_client: int = 256) -> AsyncIterator[str]:
    port = free_port()
    app = create_node_app(node, TOKEN)
    server = node_server(app, host="127.0.0.1", port=port, max_connections_per_client=per_client)
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(250):
            if server.started or task.done():
                break
            await asyncio.sleep(0.02)
        assert server.started
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def test_a_remote_tunnel_relays_both_ways_and_ends_with_the_server() -> None:
    node = FakeNode()
    await node.create_sandbox(SandboxSpec("sb-1"))
    async with served(node) as url, serving(echo) as port:
        remote = RemoteNode(url, TOKEN)
        try:
            tunnel = await remote.open_port("sb-1", port)
            payload = b"p" * (3 * 1024 * 1024)
            writer = asyncio.create_task(tunnel.write(payload))
            received = bytearray()
            async with asyncio.timeout(20):
                while len(received) < len(payload):
                    received += await tunnel.read()
            await writer
            await tunnel.close_write()
            assert await read_all(tunnel) == b""
            assert bytes(received) == payload
            await tunnel.aclose()
        finally:
            await remote.aclose()


async def test_negative_remote_tunnels_carry_the_nodes_errors() -> None:
    node = FakeNode()
    await node.create_sandbox(SandboxSpec("sb-1"))
    async with served(node) as url:
        remote = RemoteNode(url, TOKEN)
        with pytest.raises(ConnectionRefused, match="nothing listens"):
            await remote.open_port("sb-1", free_port())
        with pytest.raises(NotFound):
            await remote.open_port("sb-nope", 8080)
        await remote.aclose()
        wrong = RemoteNode(url, "wrong-token")
        with pytest.raises(Unavailable, match="403"):
            await wrong.open_port("sb-1", 8080)
        await wrong.aclose()


async def test_closed_tunnels_give_back_their_connection_slot() -> None:
    node = FakeNode()
    await node.create_sandbox(SandboxSpec("sb-1"))
    async with served(node, per_client=3) as url, serving(echo) as port:
        remote = RemoteNode(url, TOKEN)
        for _ in range(6):  # twice the cap: each closed tunnel freed its slot
            tunnel = await remote.open_port("sb-1", port)
            await tunnel.write(b"x")
            assert await tunnel.read() == b"x"
            await tunnel.aclose()
            await asyncio.sleep(0.05)
        await remote.aclose()
