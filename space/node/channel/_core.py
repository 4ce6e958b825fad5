"""The machinery under GuestChannel: frame reading and validation, stream bookkeeping,
flow control and failure handling. Public operations live in space.node.channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar, cast

from space.node.api import (
    InvalidArgument,
    ResourceExhausted,
    Timeout,
    Unavailable,
    error_for_code,
)
from space.node.channel import _parse as parse
from space.node.channel._budget import BudgetLimits, ChannelAbuse, ChannelBudget
from space.node.channel._liveness import (
    DEFAULT_PING_INTERVAL_S,
    DEFAULT_SILENCE_TIMEOUT_S,
    Liveness,
)
from space.node.channel._streams import (
    GRANT_THRESHOLD_BYTES,
    Data,
    EventParser,
    Final,
    GuestStream,
    ResultParser,
)
from space.protocol import (
    DATA_CHUNK_BYTES,
    MAX_PING_BYTES,
    MAX_STREAMS,
    Channel,
    Frame,
    FrameDecoder,
    FrameKind,
    ProtocolError,
    check_length,
    decode_credit,
    decode_data,
    decode_eof,
    decode_json,
    encode_credit,
    encode_data_frame,
    encode_eof,
    encode_frame,
    encode_json,
    length_prefix_bytes,
    parse_body,
    unpack_length,
)

__all__ = ["MAX_LIST_ITEMS", "READ_CHUNK_BYTES", "AbuseHandler", "ChannelCore"]

_log = logging.getLogger("space.node.channel")
T = TypeVar("T")
#: Called once with the reason when the guest abuses its channel (space.node.channel._budget).
AbuseHandler = Callable[[str], None]

#: Most entries a file.list or process.list answer may carry in total.
MAX_LIST_ITEMS = 10_000
#: Bytes we may have queued towards a guest that does not read (PONG floods) before we
#: call it a violation.
MAX_UNREAD_BYTES = 8 * 1024 * 1024
#: Most bytes read (and parsed) from the guest before the reader yields to the event
#: loop: at most ~7,000 minimal frames, a few ms of parsing, between two turns of the
#: other sandboxes' channels and the HTTP API.
READ_CHUNK_BYTES = 64 * 1024
_GUEST_MAY_NOT_SEND = (FrameKind.HELLO, FrameKind.OPEN, FrameKind.SIGNAL, FrameKind.CANCEL)
#: The payload of the PINGs that keep a waiting request informed; its PONG matches no
#: ``ping()`` waiter (their tokens are 8 random bytes) and only counts as a sign of life.
_KEEPALIVE = b"alive"


class ChannelCore:
    """State and frame handling of one channel; see space.node.channel.GuestChannel."""

    hello: dict[str, object]

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        sandbox_id: str,
        *,
        silence_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S,
        ping_interval_s: float = DEFAULT_PING_INTERVAL_S,
        on_abuse: AbuseHandler | None = None,
        budget: BudgetLimits | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._sandbox_id = sandbox_id
        self._liveness = Liveness(
            self._send_keepalive,
            silence_timeout_s=silence_timeout_s,
            ping_interval_s=ping_interval_s,
        )
        self._streams: dict[int, GuestStream] = {}
        self._next_id = 1
        self._pings: dict[bytes, asyncio.Future[None]] = {}
        self._closed = False
        self._failure: Unavailable | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._on_abuse = on_abuse
        self.budget = ChannelBudget(budget)
        #: Why the channel was closed for abuse, if it was.
        self.abuse: str | None = None
        self.hello = {}

    @property
    def closed(self) -> bool:
        return self._closed

    def reassign(self, sandbox_id: str, *, on_abuse: AbuseHandler | None = None) -> None:
        """Name another sandbox in errors, and report abuse to ``on_abuse``, from now
        on: a pool VM handed over keeps its channel (the guest session held no
        tenant's requests)."""
        self._sandbox_id = sandbox_id
        self._on_abuse = on_abuse

    async def close(self) -> None:
        """Close the channel; pending calls raise Unavailable. Idempotent."""
        self._shutdown(Unavailable("guest channel closed", sandbox_id=self._sandbox_id))
        if self._reader_task is not None and self._reader_task is not asyncio.current_task():
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader_task
        await self._close_writer()

    async def _close_writer(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    def _fail(self, reason: str, *, level: int = logging.ERROR) -> None:
        """The channel broke: log once, fail everything pending, close the writer."""
        if self._closed:
            return
        _log.log(level, "guest channel of sandbox %s closed: %s", self._sandbox_id, reason)
        self._shutdown(Unavailable(f"guest channel broken: {reason}", sandbox_id=self._sandbox_id))
        self._writer.close()

    def _shutdown(self, failure: Unavailable) -> None:
        if self._closed:
            return
        self._closed = True
        self._failure = failure
        for stream in self._streams.values():
            stream.finish(Final(error=failure))
        self._streams.clear()
        for waiter in self._pings.values():
            if not waiter.done():
                waiter.set_exception(failure)
        self._pings.clear()

    def _unavailable(self) -> Unavailable:
        return self._failure or Unavailable("guest channel closed", sandbox_id=self._sandbox_id)

    # -- reading --

    async def _read_frame(self) -> Frame:
        length = unpack_length(await self._reader.readexactly(length_prefix_bytes()))
        check_length(length)  # before a byte of the body is buffered
        return parse_body(await self._reader.readexactly(length))

    async def _read_loop(self) -> None:
        decoder = FrameDecoder()
        try:
            while True:
                chunk = await self._reader.read(READ_CHUNK_BYTES)
                if not chunk:
                    partial = decoder.buffered_bytes
                    self._fail(f"EOF inside a frame ({partial} B)" if partial else "EOF")
                    return
                frames = decoder.feed(chunk)
                if frames:
                    self._liveness.heard()
                for frame in frames:
                    self._dispatch(frame)
                self.budget.charge(len(frames), len(chunk))
                # Yield after every chunk, and stop reading while over budget: the
                # guest's writes then block in the guest (back-pressure through QEMU).
                await asyncio.sleep(self.budget.throttle_s())
        except ChannelAbuse as exc:
            self._abused(str(exc))
        except ProtocolError as exc:
            self._fail(f"protocol violation: {exc}")
        except OSError as exc:
            self._fail(f"read failed: {exc}")

    def _abused(self, reason: str) -> None:
        """Close the channel for abuse and report it (once): the node stops the VM."""
        if self._closed:
            return
        self.abuse = reason
        self._fail(reason, level=logging.WARNING)
        if self._on_abuse is not None:
            try:
                self._on_abuse(reason)
            except Exception:  # the channel is closed either way
                _log.exception("sandbox %s: handling channel abuse failed", self._sandbox_id)

    def _dispatch(self, frame: Frame) -> None:
        kind = frame.kind
        if kind in _GUEST_MAY_NOT_SEND or (kind is FrameKind.RESULT and frame.stream == 0):
            raise ProtocolError(f"the guest may not send {kind.name} on stream {frame.stream}")
        if kind in (FrameKind.PING, FrameKind.PONG):
            self._on_ping_pong(frame)
            return
        stream = self._streams.get(frame.stream)
        if stream is None:
            if kind is not FrameKind.CREDIT:
                raise ProtocolError(f"{kind.name} for unknown stream {frame.stream}")
            decode_credit(frame.payload)
            # A few may cross our stream's end (a race); a flood makes no sense.
            self.budget.senseless(f"CREDIT for stream {frame.stream}, not open")
            return
        if kind is FrameKind.DATA:
            channel, data = decode_data(frame.payload)
            stream.on_data(channel, data, len(frame.payload))
        elif kind is FrameKind.EOF:
            if decode_eof(frame.payload) is Channel.INPUT:
                raise ProtocolError("the guest sent EOF on INPUT")
            if decode_eof(frame.payload) is Channel.OUTPUT:
                stream.on_output_eof()
        elif kind is FrameKind.CREDIT:
            stream.on_credit(decode_credit(frame.payload))
        elif kind is FrameKind.EVENT:
            stream.on_event(decode_json(frame.payload))
        else:
            self._on_result(stream, decode_json(frame.payload))

    def _on_ping_pong(self, frame: Frame) -> None:
        if frame.stream != 0 or len(frame.payload) > MAX_PING_BYTES:
            raise ProtocolError("malformed PING/PONG")
        if frame.kind is FrameKind.PONG:
            waiter = self._pings.pop(frame.payload, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            elif waiter is None and frame.payload != _KEEPALIVE:
                # A late answer to a ping() given up is a race; a flood makes no sense.
                self.budget.senseless("a PONG that answers no PING")
            return
        if self._writer.transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
            raise ProtocolError("the guest does not read what we send")
        self._writer.write(encode_frame(FrameKind.PONG, 0, frame.payload))

    def _on_result(self, stream: GuestStream, message: dict[str, object]) -> None:
        ok = message.get("ok")
        if ok is False:
            code, text = parse.parse_error(message)
            final = Final(error=error_for_code(code, text, sandbox_id=self._sandbox_id))
        elif ok is True:
            final = Final(value=stream.parse_result(message))
        else:
            raise ProtocolError("RESULT without a boolean 'ok'")
        # Only a valid RESULT ends the stream: on a violation it is failed with the rest.
        del self._streams[stream.id]
        stream.finish(final)

    # -- writing --

    async def _send(self, kind: FrameKind, stream_id: int, payload: bytes = b"") -> None:
        await self._send_frame(encode_frame(kind, stream_id, payload))

    async def _send_frame(self, frame: bytes) -> None:
        if self._closed:
            raise self._unavailable()
        try:
            self._writer.write(frame)
            await self._writer.drain()
        except (OSError, RuntimeError) as exc:
            self._fail(f"write failed: {exc}")
            raise self._unavailable() from None

    def _send_keepalive(self) -> None:
        """PING a silent guest on behalf of the waits on it (space.node.channel._liveness).

        Written without waiting for the buffer to drain (it runs in a timer callback);
        skipped while a guest that does not read has MAX_UNREAD_BYTES queued: its
        silence then speaks for itself.
        """
        if self._closed or self._writer.transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
            return
        with contextlib.suppress(OSError, RuntimeError):  # a broken pipe shows up as EOF
            self._writer.write(encode_frame(FrameKind.PING, 0, _KEEPALIVE))

    # -- streams --

    async def _open_stream(
        self,
        request: Mapping[str, object],
        parse_result: ResultParser,
        parse_event: EventParser | None = None,
        *,
        max_events: int = 0,
        accepts_data: bool = False,
    ) -> GuestStream:
        if self._closed:
            raise self._unavailable()
        if len(self._streams) >= MAX_STREAMS:
            raise ResourceExhausted(
                f"{MAX_STREAMS} streams already open", sandbox_id=self._sandbox_id
            )
        stream_id = self._next_id
        try:
            opening = encode_frame(FrameKind.OPEN, stream_id, encode_json(dict(request)))
        except ProtocolError as exc:  # the request itself is too large
            raise InvalidArgument(str(exc), sandbox_id=self._sandbox_id) from None
        self._next_id += 2
        op = str(request["op"])
        stream = GuestStream(stream_id, op, parse_result, parse_event, max_events, accepts_data)
        self._streams[stream_id] = stream
        # Even the OPEN waits on the guest: a full buffer drains only as the guest reads.
        await self._call(stream, lambda: self._send_frame(opening))
        return stream

    async def _next_item(self, stream: GuestStream) -> object:
        """The stream's next item; DATA is credited back, a failed RESULT is raised.

        Waits as long as it takes: callers bound it with ``_call``.
        """
        item = await stream.queue.get()
        if isinstance(item, Data) and not stream.done and not self._closed:
            stream.unacked += item.payload_size
            if stream.unacked >= GRANT_THRESHOLD_BYTES:
                grant, stream.unacked = stream.unacked, 0
                stream.recv_allowed += grant
                await self._send(FrameKind.CREDIT, stream.id, encode_credit(grant))
        if isinstance(item, Final):
            if item.error is not None:
                raise item.error
            return item.value
        return item

    async def _abandon(self, stream: GuestStream) -> None:
        """Stop caring about a stream: CANCEL it; its late frames are read and dropped.

        The CANCEL is queued without waiting for the buffer to drain: the stream may be
        given up precisely because the guest stopped reading.
        """
        if stream.abandoned or stream.done:
            return
        stream.abandoned = True
        while not stream.queue.empty():
            stream.queue.get_nowait()
        if not self._closed:
            try:
                self._writer.write(encode_frame(FrameKind.CANCEL, stream.id))
            except (OSError, RuntimeError) as exc:
                self._fail(f"write failed: {exc}")

    async def _call(self, stream: GuestStream, operation: Callable[[], Awaitable[T]]) -> T:
        """Run ``operation`` while the guest is alive; abandon the stream on any failure.

        Raises Timeout once the guest has sent nothing for the silence timeout, however
        long the operation has been waiting (space.node.channel._liveness).
        """
        try:
            async with self._liveness.watch():
                return await operation()
        except TimeoutError:
            await self._abandon(stream)
            raise self._silent(stream.op) from None
        except BaseException:
            await asyncio.shield(self._abandon(stream))
            raise

    def _silent(self, op: str) -> Timeout:
        liveness = self._liveness
        return Timeout(
            f"{op}: the guest sent nothing for {liveness.silence_timeout_s} s "
            f"(pinged every {liveness.ping_interval_s} s)",
            sandbox_id=self._sandbox_id,
        )

    async def _request(
        self,
        request: Mapping[str, object],
        parse_result: Callable[[dict[str, object]], T],
        parse_event: EventParser | None = None,
        max_events: int = 0,
    ) -> T:
        stream = await self._open_stream(request, parse_result, parse_event, max_events=max_events)
        # List batches are absorbed by their parse_event, so the next item is the RESULT.
        return cast(T, await self._call(stream, lambda: self._next_item(stream)))

    async def _send_input(self, stream: GuestStream, chunks: list[bytes]) -> None:
        """Send ``chunks`` then EOF on INPUT; TimeoutError if the guest falls silent."""
        for chunk in chunks:
            await self._send_chunk(stream, chunk)
        if not stream.done:
            async with self._liveness.watch():
                await self._send(FrameKind.EOF, stream.id, encode_eof(Channel.INPUT))

    async def _send_chunk(self, stream: GuestStream, chunk: bytes) -> None:
        """Send ``chunk`` as the guest's credit allows; TimeoutError if it falls silent."""
        step = DATA_CHUNK_BYTES - 1
        view = memoryview(chunk)
        async with self._liveness.watch():
            for start in range(0, len(view), step):
                data = view[start : start + step]
                while stream.send_credit < len(data) + 1 and not stream.done:
                    stream.credit_changed.clear()
                    await stream.credit_changed.wait()
                if stream.done:
                    return  # the guest answered early (an error): the caller reads it
                stream.send_credit -= len(data) + 1
                await self._send_frame(encode_data_frame(stream.id, Channel.INPUT, data))
