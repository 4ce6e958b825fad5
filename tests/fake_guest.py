"""A scripted guest on a socketpair, for tests of the host's GuestChannel.

``connect`` opens a GuestChannel to a FakeGuest that has answered HELLO; from then on
the test plays spaced frame by frame (``frame`` reads what the host sent, ``send``
writes anything, well-formed or not). Shared by tests/security/test_hostile_guest.py
(a guest that breaks the protocol) and tests/unit/test_channel_liveness.py (a guest
that is slow, or silent).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Mapping
from typing import Any

from space.node.channel import GuestChannel
from space.protocol import Frame, FrameDecoder, FrameKind, decode_json, encode_json

__all__ = ["FakeGuest", "connect"]


class FakeGuest:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._decoder = FrameDecoder()
        self._frames: list[Frame] = []

    async def frame(self) -> Frame:
        while not self._frames:
            data = await self.reader.read(65536)
            assert data, "host closed the connection"
            self._frames.extend(self._decoder.feed(data))
        return self._frames.pop(0)

    def send(self, kind: FrameKind | int, stream: int, payload: bytes = b"") -> None:
        self.writer.write(struct.pack(">IBI", len(payload) + 5, kind, stream) + payload)

    def send_json(self, kind: FrameKind, stream: int, message: dict[str, object]) -> None:
        self.send(kind, stream, encode_json(message))

    async def answer_hello(self, **override: object) -> None:
        hello = await self.frame()
        session = decode_json(hello.payload)["session"]
        answer = {"version": 1, "agent": "fake/1", "session": session} | override
        self.send_json(FrameKind.HELLO, 0, answer)
        await self.writer.drain()

    def watching(self, stream: int, path: str = "/home/user") -> None:
        """Answer a file.watch OPEN: the watch is in place (DATA lines may follow)."""
        self.send_json(FrameKind.EVENT, stream, {"event": "watching", "path": path})

    def watch_lines(self, stream: int, data: bytes) -> None:
        """file.watch's NDJSON lines (or anything else) as one DATA OUTPUT frame."""
        self.send(FrameKind.DATA, stream, bytes((1,)) + data)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()

    async def serve_pings(self) -> None:
        while True:
            frame = await self.frame()
            if frame.kind is FrameKind.PING:
                self.send(FrameKind.PONG, 0, frame.payload)


async def connect(
    sandbox_id: str, *, channel_options: Mapping[str, Any] | None = None, **hello: object
) -> tuple[GuestChannel, FakeGuest]:
    """A channel and the FakeGuest at its other end; ``hello`` overrides fields of the
    guest's HELLO, ``channel_options`` are more of GuestChannel.open's arguments
    (timing, budget, on_abuse)."""
    host_sock, guest_sock = socket.socketpair()
    host_reader, host_writer = await asyncio.open_unix_connection(sock=host_sock)
    guest = FakeGuest(*await asyncio.open_unix_connection(sock=guest_sock))
    answering = asyncio.create_task(guest.answer_hello(**hello))
    try:
        channel = await GuestChannel.open(
            host_reader,
            host_writer,
            sandbox_id=sandbox_id,
            hello_timeout_s=2,
            **(channel_options or {}),
        )
    except BaseException:
        await guest.close()
        raise
    finally:
        await answering
    return channel, guest
