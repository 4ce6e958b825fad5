"""run_control_plane on a loopback port; register_remote_node, a node's heartbeats and
``space node ls|drain|activate`` against it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result

from space.cli import main
from space.control import ControlSettings, register_remote_node, run_control_plane
from space.control.nodes import capacity_report
from space.control.server import heartbeat
from space.node.api import CapacityInfo, Unavailable
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


def _capacity_node(node_id: str) -> FakeNode:
    node = FakeNode(node_id)
    node.capacity = CapacityInfo(8192, 6000, 0, 819, 0, 14745, 20480, 15000, 0, 2048, 0, None, 20)
    return node


async def test_a_node_agent_heartbeats_and_an_operator_drains_it_from_the_command_line(
    tmp_path: Path,
) -> None:
    settings = ControlSettings(data_dir=tmp_path, node_heartbeat_s=0.2)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = asyncio.create_task(run_control_plane(settings, None, host="127.0.0.1", port=port))
    far = _capacity_node("far")
    said: list[str] = []
    beats: asyncio.Task[None] | None = None
    try:
        await _wait_until_serving(url)
        token = settings.token_file.read_text().strip()
        report = capacity_report(await far.info())
        every = await register_remote_node(url, token, "http://127.0.0.1:9", "far", capacity=report)
        assert every == 0.2
        beats = asyncio.create_task(heartbeat(url, token, "http://127.0.0.1:9", far, said.append))

        def cli(*args: str) -> Result:
            common = ["--control-url", url, "--token-file", str(settings.token_file)]
            return CliRunner().invoke(main, ["node", *args, *common])

        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as client:
            first = (await client.get(url + "/v1/nodes")).json()["nodes"][0]
            assert first["reported"]["room"] == 20
            for _ in range(100):
                await asyncio.sleep(0.1)
                now = (await client.get(url + "/v1/nodes")).json()["nodes"][0]
                if now["last_seen"] > first["last_seen"]:
                    break
            assert now["lease_expires_at"] > first["lease_expires_at"]  # renewed

        drained = await asyncio.to_thread(cli, "drain", "far")
        assert drained.exit_code == 0, drained.output
        assert "far" in drained.output and "draining" in drained.output
        listed = await asyncio.to_thread(cli, "ls")
        assert listed.exit_code == 0 and "draining" in listed.output.splitlines()[1]
        unknown = await asyncio.to_thread(cli, "drain", "nowhere")
        assert unknown.exit_code == 1 and "no node 'nowhere'" in unknown.output
        activated = await asyncio.to_thread(cli, "activate", "far")
        assert activated.exit_code == 0 and "active" in activated.output
        assert said == []
    finally:
        if beats is not None:
            beats.cancel()
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


async def test_negative_a_failing_heartbeat_is_said_once_and_retried() -> None:
    said: list[str] = []
    beats = asyncio.create_task(
        heartbeat(
            f"http://127.0.0.1:{free_port()}", "t", "http://127.0.0.1:9",
            _capacity_node("far"), said.append, 0.01,
        )
    )  # fmt: skip
    await asyncio.sleep(0.5)
    assert not beats.done()  # it goes on trying
    beats.cancel()
    assert len(said) == 1 and "heartbeat failed" in said[0]
