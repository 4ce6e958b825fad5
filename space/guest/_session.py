"""One host session and its streams, with the guest's half of flow control.

A Stream may send DATA only within the credit the host granted (``send_data`` waits for
CREDIT), and counts the host's DATA against the window the guest granted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from space.protocol import (
    DATA_CHUNK_BYTES,
    DATA_HEADER_BYTES,
    INITIAL_WINDOW_BYTES,
    Channel,
    FrameKind,
    ProtocolError,
    encode_credit,
    encode_data_frame,
    encode_eof,
    encode_frame,
    encode_json,
    pack_data_header,
)

from ._errors import SessionLost
from ._transport import Transport

__all__ = ["Chunk", "Session", "Stream"]

#: Bulk data as it travels through spaced (views avoid copying it).
Chunk = bytes | bytearray | memoryview

#: Largest credit the guest accumulates; more from a buggy host is capped, not trusted.
MAX_SEND_CREDIT = 1 << 40


class Session:
    """Everything that belongs to one host HELLO; ``end`` cancels all of its streams."""

    def __init__(self, transport: Transport, session_id: str) -> None:
        self._transport = transport
        self.generation = transport.new_generation()
        self.session_id = session_id
        self.alive = True
        self.streams: dict[int, Stream] = {}
        self.last_stream_id = 0

    async def send(self, kind: FrameKind, stream_id: int, payload: bytes = b"") -> None:
        await self.send_raw(encode_frame(kind, stream_id, payload))

    async def send_raw(self, frame: bytes | bytearray) -> None:
        """Send an already encoded frame; raises SessionLost once the session ended."""
        if not self.alive:
            raise SessionLost(self.session_id)
        await self._transport.send(frame, self.generation)

    def send_nowait(self, kind: FrameKind, stream_id: int, payload: bytes = b"") -> None:
        if self.alive:
            self._transport.send_nowait(encode_frame(kind, stream_id, payload), self.generation)

    def end(self) -> None:
        """Cancel every stream (their handlers clean up); later sends raise SessionLost."""
        self.alive = False
        for stream in list(self.streams.values()):
            stream.abort()
        self.streams.clear()


class Stream:
    """One OPENed stream: credit in both directions, INPUT inbox, signal hook."""

    def __init__(self, session: Session, stream_id: int) -> None:
        self.session = session
        self.id = stream_id
        self.task: asyncio.Task[None] | None = None
        self.cancel_requested = False
        self.on_signal: Callable[[int], None] | None = None
        self._send_credit = INITIAL_WINDOW_BYTES
        self._credit_changed = asyncio.Event()
        self._recv_allowed = INITIAL_WINDOW_BYTES
        self._inbox: asyncio.Queue[Chunk | None] = asyncio.Queue()

    # -- from the host (called synchronously by the frame dispatcher) --

    def add_credit(self, increment: int) -> None:
        self._send_credit = min(self._send_credit + increment, MAX_SEND_CREDIT)
        self._credit_changed.set()

    def receive_input(self, payload_size: int, data: Chunk) -> None:
        """Queue INPUT DATA; raises ProtocolError beyond the window we granted."""
        self._recv_allowed -= payload_size
        if self._recv_allowed < 0:
            raise ProtocolError(f"stream {self.id}: DATA beyond the granted window")
        self._inbox.put_nowait(data)

    def receive_input_eof(self) -> None:
        self._inbox.put_nowait(None)

    def abort(self) -> None:
        if self.task is not None:
            self.task.cancel()

    # -- used by operation handlers --

    async def read_input(self) -> Chunk | None:
        """Next INPUT chunk, or None at EOF. Call ``consumed`` once it is used."""
        return await self._inbox.get()

    async def consumed(self, size: int) -> None:
        """Grant the host credit for ``size`` payload bytes we no longer hold."""
        if size > 0:
            self._recv_allowed += size
            await self.session.send(FrameKind.CREDIT, self.id, encode_credit(size))

    async def send_data(self, channel: Channel, data: Chunk) -> None:
        """Send ``data`` in chunks, each within the host's credit (waits for CREDIT)."""
        step = DATA_CHUNK_BYTES - 1
        view = memoryview(data)
        for start in range(0, len(view), step):
            chunk = view[start : start + step]
            await self._take_credit(len(chunk) + 1)
            await self.session.send_raw(encode_data_frame(self.id, channel, chunk))

    async def send_data_frame(self, channel: Channel, frame: bytearray) -> None:
        """Send a DATA frame whose data the caller put at ``frame[DATA_HEADER_BYTES:]``.

        Saves a copy of bulk data; the caller must not touch ``frame`` afterwards.
        """
        size = len(frame) - DATA_HEADER_BYTES
        pack_data_header(frame, self.id, channel, size)
        await self._take_credit(size + 1)
        await self.session.send_raw(frame)

    async def _take_credit(self, size: int) -> None:
        while self._send_credit < size:
            self._credit_changed.clear()
            await self._credit_changed.wait()
        self._send_credit -= size

    async def send_eof(self, channel: Channel) -> None:
        await self.session.send(FrameKind.EOF, self.id, encode_eof(channel))

    async def send_event(self, event: dict[str, object]) -> None:
        await self.session.send(FrameKind.EVENT, self.id, encode_json(event))

    async def send_result(self, result: dict[str, object]) -> None:
        with contextlib.suppress(SessionLost):
            await self.session.send(FrameKind.RESULT, self.id, encode_json(result))


#: JSON bytes per batch of list items; a batch plus its envelope stays under MAX_JSON_BYTES.
BATCH_JSON_BYTES = 48 * 1024


async def send_batches(stream: Stream, key: str, items: list[dict[str, object]]) -> list[object]:
    """Send ``items`` as EVENT {"event": key, key: [...]} batches; return the last batch.

    The caller puts the returned batch into its RESULT, so a list that fits one message
    needs no EVENT at all.
    """
    batch: list[object] = []
    size = 0
    for item in items:
        item_size = len(encode_json(item))
        if batch and size + item_size > BATCH_JSON_BYTES:
            await stream.send_event({"event": key, key: batch})
            batch, size = [], 0
        batch.append(item)
        size += item_size + 1
    return batch
