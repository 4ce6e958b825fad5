"""Host-side stream state and the ExecStream / FileReader objects handed to callers.

A stream's queue holds at most the receive window of DATA (the guest may not send more
than we granted, and we grant only as the consumer takes data), a bounded number of
events, and one final item: the parsed RESULT or the channel's failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from space.node.api import ExecEvent, ExecExited, ExecOutput, FileStat, NodeError
from space.protocol import INITIAL_WINDOW_BYTES, Channel, ProtocolError

__all__ = [
    "ChannelExecStream",
    "ChannelFileReader",
    "ChannelPortTunnel",
    "Data",
    "Final",
    "GuestStream",
    "OutputEnd",
]

#: Grant credit once the consumer has taken this many bytes (fewer, larger CREDIT frames).
GRANT_THRESHOLD_BYTES = INITIAL_WINDOW_BYTES // 4
#: Cap on the credit the guest may grant us (a lie only makes us send what we have anyway).
MAX_SEND_CREDIT = 1 << 40


@dataclass(frozen=True, slots=True)
class Data:
    channel: Channel
    data: bytes
    payload_size: int


@dataclass(frozen=True, slots=True)
class Final:
    """The end of a stream: a parsed RESULT (``value``) or an error to raise."""

    value: object = None
    error: NodeError | None = None


@dataclass(frozen=True, slots=True)
class OutputEnd:
    """The guest's EOF on OUTPUT, queued for streams that relay a connection."""


EventParser = Callable[[dict[str, object]], object]
ResultParser = Callable[[dict[str, object]], object]


class GuestStream:
    """One stream opened by the host. Frame handlers run on the channel's reader task."""

    def __init__(
        self,
        stream_id: int,
        op: str,
        parse_result: ResultParser,
        parse_event: EventParser | None,
        max_events: int,
        accepts_data: bool,
    ) -> None:
        self.id = stream_id
        self.op = op
        self.parse_result = parse_result
        self.parse_event = parse_event
        self.max_events = max_events
        self.accepts_data = accepts_data
        #: DATA may only follow the stream's first EVENT (started, stat).
        self.data_allowed = False
        self.events = 0
        self.done = False
        self.abandoned = False
        self.queue: asyncio.Queue[Data | Final | object] = asyncio.Queue()
        self.recv_allowed = INITIAL_WINDOW_BYTES
        self.unacked = 0
        self.send_credit = INITIAL_WINDOW_BYTES
        self.credit_changed = asyncio.Event()
        #: Queue the guest's EOF OUTPUT as an OutputEnd (once): a tunnel's reader needs
        #: it, other streams end with their RESULT.
        self.queues_eof = False
        self.output_ended = False

    def on_output_eof(self) -> None:
        if self.queues_eof and not self.output_ended and not self.abandoned:
            self.output_ended = True
            self.queue.put_nowait(OutputEnd())

    def on_data(self, channel: Channel, data: bytes, payload_size: int) -> None:
        if not self.data_allowed or channel is Channel.INPUT:
            raise ProtocolError(f"stream {self.id} ({self.op}): unexpected DATA on {channel.name}")
        self.recv_allowed -= payload_size
        if self.recv_allowed < 0:
            raise ProtocolError(f"stream {self.id}: DATA beyond the granted credit")
        if not self.abandoned:
            self.queue.put_nowait(Data(channel, data, payload_size))

    def on_event(self, message: dict[str, object]) -> None:
        self.events += 1
        if self.parse_event is None or self.events > self.max_events:
            raise ProtocolError(f"stream {self.id} ({self.op}): unexpected or too many EVENTs")
        parsed = self.parse_event(message)
        self.data_allowed = self.accepts_data
        if parsed is not None and not self.abandoned:
            self.queue.put_nowait(parsed)

    def on_credit(self, increment: int) -> None:
        self.send_credit = min(self.send_credit + increment, MAX_SEND_CREDIT)
        self.credit_changed.set()

    def finish(self, final: Final) -> None:
        self.done = True
        self.queue.put_nowait(final)
        self.credit_changed.set()


class ChannelExecStream:
    """ExecStream over a channel stream (see space.node.api.interface.ExecStream)."""

    def __init__(
        self,
        pid: int,
        process_id: str,
        next_item: Callable[[], Awaitable[object]],
        abandon: Callable[[], Awaitable[None]],
        silent: bool,
        *,
        pty: bool = False,
    ) -> None:
        self.pid = pid
        self.process_id = process_id
        self.pty = pty
        self._next_item = next_item
        self._abandon = abandon
        #: A background exec's stream, which carries no events (its RESULT came already).
        self._finished = silent

    def __aiter__(self) -> AsyncIterator[ExecEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[ExecEvent]:
        while not self._finished:
            item = await self._next_item()
            if isinstance(item, Data):
                if item.channel is Channel.OUTPUT:
                    yield ExecOutput("stdout", item.data)
                else:
                    yield ExecOutput("stderr", item.data)
            elif isinstance(item, ExecExited):
                self._finished = True
                yield item

    async def aclose(self) -> None:
        """Abandon the stream: a foreground process is killed, a background one runs on."""
        if not self._finished:
            self._finished = True
            await self._abandon()


class ChannelFileReader:
    """FileReader over a channel stream (see space.node.api.interface.FileReader)."""

    def __init__(
        self,
        stat: FileStat,
        next_item: Callable[[], Awaitable[object]],
        abandon: Callable[[], Awaitable[None]],
    ) -> None:
        self.stat = stat
        self._next_item = next_item
        self._abandon = abandon
        self._finished = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        while not self._finished:
            item = await self._next_item()
            if isinstance(item, Data):
                yield item.data
            else:
                self._finished = True

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            await self._abandon()


class ChannelPortTunnel:
    """PortTunnel over a port.connect stream (see space.node.api.interface.PortTunnel)."""

    def __init__(
        self,
        port: int,
        next_item: Callable[[], Awaitable[object]],
        send: Callable[[bytes], Awaitable[None]],
        send_eof: Callable[[], Awaitable[None]],
        abandon: Callable[[], Awaitable[None]],
    ) -> None:
        self.port = port
        self._next_item = next_item
        self._send = send
        self._send_eof = send_eof
        self._abandon = abandon
        self._ended = False
        self._write_closed = False

    async def read(self) -> bytes:
        while not self._ended:
            item = await self._next_item()
            if isinstance(item, Data):
                if item.data:
                    return item.data
            else:  # OutputEnd, or the RESULT once both directions ended
                self._ended = True
        return b""

    async def write(self, data: bytes) -> None:
        if self._write_closed:
            raise ProtocolError("write after close_write")
        if data:
            await self._send(data)

    async def close_write(self) -> None:
        if not self._write_closed:
            self._write_closed = True
            await self._send_eof()

    async def aclose(self) -> None:
        self._ended = self._write_closed = True
        await self._abandon()
