"""port.connect (issue 20, port exposure) on spaced as a real subprocess (--stdio),
driven through GuestChannel.open_port, against TCP servers on the loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from space.guest._ports import MAX_CONNECTIONS
from space.node.api import ConnectionRefused, InvalidArgument, PortTunnel, ResourceExhausted
from space.node.channel import GuestChannel

from ._guest_harness import Guest, run_with_channel

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(handler: Handler, host: str = "127.0.0.1") -> AsyncIterator[int]:
    server = await asyncio.start_server(handler, host, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass  # the tunnel was closed mid-way
    finally:
        writer.close()


async def read_all(tunnel: PortTunnel) -> bytes:
    out = bytearray()
    async with asyncio.timeout(30):
        while chunk := await tunnel.read():
            out += chunk
    return bytes(out)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_bytes_written_to_a_tunnel_come_back_from_an_echo_server_in_both_directions(
    tmp_path: Path,
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        async with serving(echo) as port:
            tunnel = await channel.open_port(port)
            assert tunnel.port == port
            payload = bytes(range(256)) * 12_000  # 3 MiB: beyond one credit window
            writer = asyncio.create_task(tunnel.write(payload))
            received = bytearray()
            async with asyncio.timeout(30):
                while len(received) < len(payload):
                    received += await tunnel.read()
            await writer
            await tunnel.close_write()  # the echo server sees EOF and closes
            assert await read_all(tunnel) == b""
            assert bytes(received) == payload
            await tunnel.aclose()

    run_with_channel(tmp_path, body)


def test_a_server_that_answers_and_closes_ends_the_tunnel_with_its_bytes(tmp_path: Path) -> None:
    big = b"y" * (5 * 1024 * 1024 + 7)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(5)
        writer.write(big)
        await writer.drain()
        writer.close()

    async def body(channel: GuestChannel, guest: Guest) -> None:
        async with serving(answer) as port:
            tunnel = await channel.open_port(port)
            await tunnel.write(b"hello")
            assert await read_all(tunnel) == big
            await tunnel.aclose()

    run_with_channel(tmp_path, body)


def test_a_server_on_ipv6_loopback_is_reached(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        async with serving(echo, "::1") as port:
            tunnel = await channel.open_port(port)
            await tunnel.write(b"six")
            await tunnel.close_write()
            assert await read_all(tunnel) == b"six"

    run_with_channel(tmp_path, body)


def test_negative_a_port_nobody_listens_on_is_connection_refused(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        port = free_port()
        with pytest.raises(ConnectionRefused, match=f"nothing listens on port {port}"):
            await channel.open_port(port)
        for bad in (0, 65536, -1):
            with pytest.raises(InvalidArgument):
                await channel.open_port(bad)
        # The channel is fine afterwards.
        assert (await channel.system_info())["agent"]

    run_with_channel(tmp_path, body)


def test_negative_connections_past_the_guest_bound_are_refused_and_freed_on_close(
    tmp_path: Path,
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        async with serving(echo) as port:
            tunnels = [await channel.open_port(port) for _ in range(MAX_CONNECTIONS)]
            with pytest.raises(ResourceExhausted, match=f"{MAX_CONNECTIONS} port connections"):
                await channel.open_port(port)
            for tunnel in tunnels:
                await tunnel.aclose()
            async with asyncio.timeout(10):
                while True:  # the guest frees them as the CANCELs arrive
                    try:
                        tunnel = await channel.open_port(port)
                        break
                    except ResourceExhausted:
                        await asyncio.sleep(0.05)
            await tunnel.write(b"again")
            await tunnel.close_write()
            assert await read_all(tunnel) == b"again"

    run_with_channel(tmp_path, body)


def test_a_tunnel_does_not_hold_up_exec_on_the_same_channel(tmp_path: Path) -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(b"z" * (8 * 1024 * 1024))  # more than the window: the relay waits
            await writer.drain()
            await reader.read()
        except ConnectionError:
            pass  # the tunnel was closed under a blocked write: what the test does
        finally:
            writer.close()

    async def body(channel: GuestChannel, guest: Guest) -> None:
        async with serving(stall) as port:
            tunnel = await channel.open_port(port)
            await tunnel.read()  # the relay now waits for our credit
            async with asyncio.timeout(30):
                assert (await channel.system_info())["agent"]
            await tunnel.aclose()

    run_with_channel(tmp_path, body)
