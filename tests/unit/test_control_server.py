"""run_control_plane on a loopback port, and register_remote_node against it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.control import ControlSettings, register_remote_node, run_control_plane
from space.node.api import Unavailable
from space.node.api.http_connections import MAX_HEADER_BYTES
from tests.ports import free_port
from tests.unit._raw_http import closed_by_server
from tests.unit.fakes import FakeNode

pytestmark = pytest.mark.anyio


async def _wait_until_serving(url: str) -> None:
    async with httpx.AsyncClient() as client:
        for _ in range(200):
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(url + "/openapi.json")).status_code == 200:
                    return
            await asyncio.sleep(0.02)
    raise AssertionError("control plane did not start")


async def test_a_node_registers_with_a_running_control_plane(tmp_path: Path) -> None:
    settings = ControlSettings(data_dir=tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = asyncio.create_task(
        run_control_plane(settings, FakeNode(), host="127.0.0.1", port=port)
    )
    try:
        await _wait_until_serving(url)
        token = settings.token_file.read_text().strip()
        with pytest.raises(Unavailable):
            await register_remote_node(url, "wrong", "http://127.0.0.1:9", "far")
        await register_remote_node(url, token, "http://127.0.0.1:9", "far")
        assert (tmp_path / "space.db").exists()
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
    with socket.socket() as sock:  # the port is free again: nothing left listening
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


async def test_negative_registering_with_an_absent_control_plane_is_unavailable() -> None:
    with pytest.raises(Unavailable):
        await register_remote_node("http://127.0.0.1:9", "t", "http://127.0.0.1:9", "far")


async def test_negative_a_taken_port_is_unavailable(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(Unavailable, match="cannot listen"):
            await run_control_plane(
                ControlSettings(data_dir=tmp_path), None, host="127.0.0.1", port=port
            )


@contextlib.asynccontextmanager
async def _serving(tmp_path: Path, **bounds: Any) -> AsyncIterator[int]:
    """run_control_plane on a free loopback port with ``bounds``; yields the port."""
    port = free_port()
    server = asyncio.create_task(
        run_control_plane(
            ControlSettings(data_dir=tmp_path), FakeNode(), host="127.0.0.1", port=port, **bounds
        )
    )
    try:
        await _wait_until_serving(f"http://127.0.0.1:{port}")
        yield port
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


async def test_negative_a_request_whose_headers_never_end_is_closed(tmp_path: Path) -> None:
    async with _serving(tmp_path, header_timeout_s=0.3) as port:
        silent = await asyncio.open_connection("127.0.0.1", port)
        trickling = await asyncio.open_connection("127.0.0.1", port)
        trickling[1].write(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\n")
        loop = asyncio.get_running_loop()
        started = loop.time()
        for _, writer in (silent, trickling):
            await writer.drain()
        assert await closed_by_server(silent[0], within_s=5) == b""
        assert await closed_by_server(trickling[0], within_s=5) == b""
        assert loop.time() - started < 3
        for _, writer in (silent, trickling):
            writer.close()


async def test_a_request_sent_in_time_is_served_on_a_kept_alive_connection(
    tmp_path: Path,
) -> None:
    async with (
        _serving(tmp_path, header_timeout_s=0.5) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        for _ in range(3):
            assert (await client.get("/openapi.json")).status_code == 200
            await asyncio.sleep(0.3)  # the header deadline is per request


async def test_negative_headers_over_the_cap_answer_400(tmp_path: Path) -> None:
    async with _serving(tmp_path) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        padding = b"X-Pad: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\n"
        writer.write(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n" + padding + b"\r\n")
        with contextlib.suppress(ConnectionResetError):
            await writer.drain()
        answer = await closed_by_server(reader, within_s=5)
        assert answer.startswith(b"HTTP/1.1 400")
        writer.close()


async def test_negative_a_client_over_its_connection_cap_is_closed(tmp_path: Path) -> None:
    async with _serving(tmp_path, max_connections_per_client=3) as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await asyncio.sleep(0.1)  # the server has taken them
        extra_reader, extra_writer = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_by_server(extra_reader, within_s=5) == b""
        extra_writer.close()
        held.pop()[1].close()
        await asyncio.sleep(0.1)  # the server has seen it go
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/openapi.json")).status_code == 200
        for _, writer in held:
            writer.close()
