"""run_control_plane on a loopback port, and register_remote_node against it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

import httpx
import pytest

from space.control import ControlSettings, register_remote_node, run_control_plane
from space.node.api import Unavailable
from tests.unit.fakes import FakeNode

pytestmark = pytest.mark.anyio


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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
    port = _free_port()
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
