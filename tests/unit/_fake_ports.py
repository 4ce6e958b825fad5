"""FakeNode's open_port (issue 20): the "guest" server is a server on the host's
loopback at the same port, reached over a plain TCP connection (the real node relays
it through spaced; tests/unit/test_guest_ports.py covers that half)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from space.node.api import MAX_TUNNEL_CHUNK_BYTES, ConnectionRefused, InvalidArgument

__all__ = ["FakePorts", "LoopbackTunnel"]


class LoopbackTunnel:
    def __init__(self, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.port = port
        self._reader = reader
        self._writer = writer

    async def read(self) -> bytes:
        try:
            return await self._reader.read(MAX_TUNNEL_CHUNK_BYTES)
        except ConnectionResetError:
            return b""

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def close_write(self) -> None:
        with contextlib.suppress(OSError):
            self._writer.write_eof()

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()


class FakePorts:
    """``open_ports`` counts the tunnels open now, ``opened`` all ever opened."""

    def __init__(self) -> None:
        self.opened: list[tuple[str, int]] = []

    def _box(self, method: str, sandbox_id: str) -> Any:
        raise NotImplementedError  # FakeNode's

    async def open_port(self, sandbox_id: str, port: int) -> LoopbackTunnel:
        self._box("open_port", sandbox_id)
        if not 1 <= port <= 65535:
            raise InvalidArgument(f"port must be 1 to 65535, got {port}", sandbox_id=sandbox_id)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            raise ConnectionRefused(
                f"connection_refused: nothing listens on port {port}", sandbox_id=sandbox_id
            ) from None
        self.opened.append((sandbox_id, port))
        return LoopbackTunnel(port, reader, writer)
