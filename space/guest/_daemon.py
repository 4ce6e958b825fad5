"""The frame dispatcher of spaced: sessions, streams and operation routing.

Frames from the host arrive through ``on_bytes`` (synchronously, on the loop). Nothing
but HELLO is looked at before a session exists; every HELLO starts a new session and
ends the previous one (foreground streams cancelled, background processes kept). A
protocol violation by the host ends the session and resets the decoder.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable

from space.protocol import (
    MAX_PING_BYTES,
    MAX_STREAMS,
    PROTOCOL_VERSION,
    Channel,
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameKind,
    Op,
    ProtocolError,
    decode_credit,
    decode_data_view,
    decode_eof,
    decode_json,
    encode_json,
)

from . import AGENT, _exec, _files, _identity, _ports, _watch
from ._errors import OpError, SessionLost, from_oserror
from ._identity import IdentitySystem
from ._metrics import MetricsSampler
from ._processes import ProcessTable
from ._request import Accounts, Fields
from ._session import Session, Stream
from ._spawner import Spawners
from ._transport import Transport

__all__ = ["Daemon"]

_log = logging.getLogger("spaced")
Handler = Callable[["Daemon", Stream, Fields], Awaitable[dict[str, object]]]

_HANDLERS: dict[str, Handler] = {
    Op.EXEC: lambda d, s, f: _exec.op_exec(s, f, d.accounts, d.processes),
    Op.PROCESS_LIST: lambda d, s, f: _exec.op_list(s, d.processes),
    Op.PROCESS_ATTACH: lambda d, s, f: _exec.op_attach(s, f, d.processes),
    Op.PROCESS_KILL: lambda d, s, f: _exec.op_kill(f, d.processes),
    Op.PROCESS_INPUT: lambda d, s, f: _exec.op_input(s, f, d.processes),
    Op.PROCESS_RESIZE: lambda d, s, f: _exec.op_resize(f, d.processes),
    Op.FILE_READ: lambda d, s, f: _files.op_read(s, f, d.accounts),
    Op.FILE_WRITE: lambda d, s, f: _files.op_write(s, f, d.accounts),
    Op.FILE_LIST: lambda d, s, f: _files.op_list(s, f, d.accounts),
    Op.FILE_STAT: lambda d, s, f: _files.op_stat(f, d.accounts),
    Op.FILE_MKDIR: lambda d, s, f: _files.op_mkdir(f, d.accounts),
    Op.FILE_REMOVE: lambda d, s, f: _files.op_remove(f, d.accounts),
    Op.FILE_RENAME: lambda d, s, f: _files.op_rename(f, d.accounts),
    Op.FILE_WATCH: lambda d, s, f: _watch.op_watch(s, f, d.accounts, d.watches),
    Op.SYSTEM_INFO: lambda d, s, f: _system_info(d.processes.spawners.starting),
    Op.SYSTEM_IDENTITY: lambda d, s, f: _identity.op_identity(f, d.identity),
    Op.SYSTEM_METRICS: lambda d, s, f: d.metrics.sample(),
    Op.PORT_CONNECT: lambda d, s, f: _ports.op_connect(
        s, f, d.port_connections, _ports.IDLE_TIMEOUT_S
    ),
}


class Daemon:
    """spaced's state. ``identity`` is where system.identity's changes go: required, so
    whoever builds a Daemon decides between the real system and a recording one."""

    accounts: Accounts
    processes: ProcessTable
    watches: _watch.Watches
    identity: IdentitySystem
    metrics: MetricsSampler
    port_connections: _ports.PortConnections

    def __init__(
        self,
        transport: Transport,
        accounts: Accounts,
        *,
        identity: IdentitySystem,
        spawners: Spawners | None = None,
    ) -> None:
        self.transport = transport
        self.accounts = accounts
        self.identity = identity
        self.processes = ProcessTable(spawners=spawners or Spawners())
        self.watches = _watch.Watches()
        #: Holds the previous CPU reading: a sample covers the time since the last one.
        self.metrics = MetricsSampler()
        self.port_connections = _ports.PortConnections()
        self.session: Session | None = None
        self.stopped = asyncio.Event()
        self._decoder = FrameDecoder()
        transport.on_write_error = self._on_write_error

    async def run(self) -> None:
        """Serve until the transport ends for good (stdio EOF); then kill our processes."""
        self.transport.start(self.on_bytes, self.on_hangup, self.stopped.set)
        try:
            await self.stopped.wait()
        finally:
            self.end_session("stopping")
            self.processes.kill_all()
            await self.processes.spawners.close()
            await self.transport.close()

    # -- transport events --

    def on_bytes(self, data: bytes) -> None:
        try:
            for frame in self._decoder.feed(data):
                self._on_frame(frame)
        except ProtocolError as exc:
            _log.error("protocol violation by the host: %s", exc)
            self.end_session("protocol violation")
            self._decoder = FrameDecoder()

    def on_hangup(self) -> None:
        self.end_session("host disconnected")
        self._decoder = FrameDecoder()

    def _on_write_error(self, exc: OSError) -> None:
        self.end_session(f"write failed: {exc}")

    def end_session(self, why: str) -> None:
        if self.session is not None:
            _log.info("session %s ended: %s", self.session.session_id, why)
            self.session.end()
            self.session = None

    # -- frames --

    def _on_frame(self, frame: Frame) -> None:
        if frame.kind is FrameKind.HELLO:
            self._on_hello(frame.payload)
            return
        session = self.session
        if session is None:
            return  # nothing but HELLO counts before a session exists
        if frame.kind is FrameKind.PING:
            if len(frame.payload) > MAX_PING_BYTES:
                raise ProtocolError("PING payload too long")
            session.send_nowait(FrameKind.PONG, 0, frame.payload)
        elif frame.kind is FrameKind.OPEN:
            self._on_open(session, frame)
        elif frame.kind in (FrameKind.RESULT, FrameKind.EVENT, FrameKind.PONG):
            if frame.kind is not FrameKind.PONG:
                raise ProtocolError(f"the host may not send {frame.kind.name}")
        else:
            self._on_stream_frame(session, frame)

    def _on_hello(self, payload: bytes) -> None:
        hello = decode_json(payload)
        versions = hello.get("versions")
        session_id = hello.get("session")
        if not isinstance(session_id, str) or len(session_id) > 128:
            raise ProtocolError("HELLO without a valid session id")
        self.end_session("new HELLO")
        session = Session(self.transport, session_id)
        if not isinstance(versions, list) or PROTOCOL_VERSION not in versions:
            answer: dict[str, object] = {
                "version": None,
                "error": f"spaced speaks {PROTOCOL_VERSION}",
            }
            session.send_nowait(FrameKind.HELLO, 0, encode_json(answer))
            session.alive = False
            return
        self.session = session
        answer = {"version": PROTOCOL_VERSION, "agent": AGENT, "session": session_id}
        answer |= {"boot_id": _boot_id(), "hostname": socket.gethostname()}
        session.send_nowait(FrameKind.HELLO, 0, encode_json(answer))

    def _on_open(self, session: Session, frame: Frame) -> None:
        if frame.stream == 0 or frame.stream <= session.last_stream_id:
            raise ProtocolError(f"OPEN reuses stream id {frame.stream}")
        session.last_stream_id = frame.stream
        if len(session.streams) >= MAX_STREAMS:
            error = OpError(ErrorCode.RESOURCE_EXHAUSTED, f"{MAX_STREAMS} streams open")
            session.send_nowait(FrameKind.RESULT, frame.stream, encode_json(error.to_result()))
            return
        stream = Stream(session, frame.stream)
        session.streams[frame.stream] = stream
        stream.task = asyncio.get_running_loop().create_task(self._run(stream, frame.payload))

    def _on_stream_frame(self, session: Session, frame: Frame) -> None:
        stream = session.streams.get(frame.stream)
        if stream is None:
            return  # a stream that just ended: the host's frames crossed our RESULT
        if frame.kind is FrameKind.DATA:
            channel, data = decode_data_view(frame.payload)
            if channel is not Channel.INPUT:
                raise ProtocolError("the host sent DATA on an output channel")
            stream.receive_input(len(frame.payload), data)
        elif frame.kind is FrameKind.EOF:
            if decode_eof(frame.payload) is Channel.INPUT:
                stream.receive_input_eof()
        elif frame.kind is FrameKind.CREDIT:
            stream.add_credit(decode_credit(frame.payload))
        elif frame.kind is FrameKind.SIGNAL:
            signum = decode_json(frame.payload).get("signal")
            if isinstance(signum, int) and 1 <= signum <= 64 and stream.on_signal:
                stream.on_signal(signum)
        elif frame.kind is FrameKind.CANCEL:
            stream.cancel_requested = True
            stream.abort()

    # -- operations --

    async def _run(self, stream: Stream, payload: bytes) -> None:
        try:
            result = await self._answer(stream, payload)
            await stream.send_result(result)
        except (SessionLost, asyncio.CancelledError):
            pass  # the session is gone: nobody to answer
        finally:
            stream.session.streams.pop(stream.id, None)

    async def _answer(self, stream: Stream, payload: bytes) -> dict[str, object]:
        try:
            request = decode_json(payload)
            handler = _HANDLERS.get(str(request.get("op")))
            if handler is None:
                raise OpError(ErrorCode.UNSUPPORTED, f"unknown op {request.get('op')!r}")
            return await handler(self, stream, Fields(request))
        except ProtocolError as exc:
            return OpError(ErrorCode.INVALID_ARGUMENT, str(exc)).to_result()
        except OpError as exc:
            return exc.to_result()
        except OSError as exc:
            return from_oserror(exc).to_result()
        except asyncio.CancelledError:
            if not stream.cancel_requested or not stream.session.alive:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            return OpError(ErrorCode.INTERNAL, "cancelled by the host").to_result()
        except SessionLost:
            raise
        except Exception as exc:  # a bug of ours must end this stream, not the daemon
            _log.exception("operation failed")
            return OpError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}").to_result()


async def _system_info(spawner_starting: bool) -> dict[str, object]:
    return {
        "ok": True,
        "hostname": socket.gethostname(),
        "boot_id": _boot_id(),
        "uptime_s": _uptime_s(),
        "agent": AGENT,
        "spawner_starting": spawner_starting,
    }


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return ""


def _uptime_s() -> float:
    try:
        with open("/proc/uptime", encoding="ascii") as file:
            return float(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.monotonic()
