"""The host's end of the guest channel: one GuestChannel per VM connection.

It speaks docs/protocol.md over an asyncio stream pair. Everything the guest sends is
treated as hostile: a frame's length is checked before its body is read, every frame
and JSON message is validated, and per-stream memory is bounded by the credit window.
Any violation (or EOF) closes this channel only: it logs one error on the
"space.node.channel" logger, fails every pending call with Unavailable and marks
``closed``; the node reconnects by opening a new GuestChannel. What the guest may make
us read is budgeted (frames and bytes per second, senseless frames): past the budget
the channel stops reading for a while, and a guest that keeps at it has its channel
closed with one warning and ``on_abuse`` called (space.node.channel._budget).

Every method raises space.node.api.errors leaves carrying the sandbox id: guest RESULT
errors map through ``error_for_code``. No call is failed for being slow: every wait on the
guest (an answer, a process's start or its next output, a file's next chunk, credit to
send) lasts as long as the guest keeps sending frames, on any stream, and a silent guest
is PINGed every ``ping_interval_s``. A wait raises Timeout (and abandons its stream with
CANCEL) only once the guest has sent nothing at all for ``silence_timeout_s``
(space.node.channel._liveness); a channel that ends raises Unavailable at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterable

from space.node.api import (
    ExecRequest,
    ExecStream,
    FileReader,
    FileStat,
    InvalidArgument,
    NodeError,
    ProcessInfo,
    ProcessSelector,
    PtySize,
    Timeout,
    Unavailable,
)
from space.node.channel import _parse as parse
from space.node.channel._budget import BudgetLimits
from space.node.channel._core import MAX_LIST_ITEMS, AbuseHandler, ChannelCore
from space.node.channel._liveness import DEFAULT_PING_INTERVAL_S, DEFAULT_SILENCE_TIMEOUT_S
from space.node.channel._streams import (
    ChannelExecStream,
    ChannelFileReader,
    ChannelPortTunnel,
    GuestStream,
    ResultParser,
)
from space.node.channel._watch import ChannelWatchStream
from space.protocol import (
    MAX_INPUT_BYTES,
    MAX_PTY_SIZE,
    PROTOCOL_VERSION,
    Frame,
    FrameKind,
    Identity,
    Metrics,
    Op,
    ProtocolError,
    decode_json,
    encode_frame,
    encode_json,
)

__all__ = ["DEFAULT_PING_INTERVAL_S", "DEFAULT_SILENCE_TIMEOUT_S", "GuestChannel"]


class GuestChannel(ChannelCore):
    """A session with one guest's spaced; see the module docstring for the error contract."""

    # -- lifecycle --

    @classmethod
    async def open(
        cls,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        sandbox_id: str,
        hello_timeout_s: float = 60.0,
        silence_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S,
        ping_interval_s: float = DEFAULT_PING_INTERVAL_S,
        on_abuse: AbuseHandler | None = None,
        budget: BudgetLimits | None = None,
    ) -> GuestChannel:
        """Send HELLO and wait for the guest's; the channel then owns ``writer``.

        Raises Timeout if no HELLO comes within ``hello_timeout_s`` (the guest answers
        no PING before its HELLO, so this one wait is a plain deadline), Unavailable if
        the connection drops, the first frame is not a valid HELLO, or no version is
        shared. On failure the writer is closed. ``silence_timeout_s`` and
        ``ping_interval_s`` bound every later wait (see the module docstring).

        ``budget`` (default: space.node.channel._budget's constants) bounds what the
        guest may make us read; a guest that abuses it gets its channel closed, and
        ``on_abuse`` is called once with the reason (``abuse`` holds it too).
        """
        channel = cls(
            reader,
            writer,
            sandbox_id,
            silence_timeout_s=silence_timeout_s,
            ping_interval_s=ping_interval_s,
            on_abuse=on_abuse,
            budget=budget,
        )
        session = secrets.token_hex(16)
        hello: dict[str, object] = {"versions": [PROTOCOL_VERSION], "session": session}
        try:
            async with asyncio.timeout(hello_timeout_s):
                writer.write(encode_frame(FrameKind.HELLO, 0, encode_json(hello)))
                await writer.drain()
                channel.hello = channel._check_hello(await channel._read_frame(), session)
        except TimeoutError:
            await channel._close_writer()
            raise Timeout(
                f"no HELLO from the guest within {hello_timeout_s} s", sandbox_id=sandbox_id
            ) from None
        except (ProtocolError, asyncio.IncompleteReadError, OSError) as exc:
            await channel._close_writer()
            raise Unavailable(f"guest HELLO failed: {exc}", sandbox_id=sandbox_id) from None
        channel._reader_task = asyncio.get_running_loop().create_task(channel._read_loop())
        return channel

    @staticmethod
    def _check_hello(frame: Frame, session: str) -> dict[str, object]:
        if frame.kind is not FrameKind.HELLO or frame.stream != 0:
            raise ProtocolError(f"expected HELLO, got {frame.kind.name}")
        answer = decode_json(frame.payload)
        if answer.get("version") != PROTOCOL_VERSION or isinstance(answer.get("version"), bool):
            error = str(answer.get("error"))[:200]
            raise ProtocolError(f"guest speaks no common version: {error}")
        if answer.get("session") != session:
            raise ProtocolError("guest HELLO answers another session")
        parse.require_str(answer, "agent", max_chars=256)
        parse.require_str(answer, "boot_id", optional=True, max_chars=256)
        parse.require_str(answer, "hostname", optional=True, max_chars=256)
        return answer

    # -- public operations --

    async def exec(self, request: ExecRequest) -> ExecStream:
        """Start a process; returns once it runs (EVENT started).

        Waits for the start as long as the guest is alive (its daemon may be slow to
        spawn under load); ``request.timeout_s`` bounds the process's run in the guest,
        not this wait. Raises the guest's error (e.g. NotFound for a missing cwd or
        program), InvalidArgument for a malformed request, Timeout (the guest fell
        silent: the stream is CANCELled, so a process that did start is killed),
        Unavailable. Iterating the returned stream raises the same way.
        """
        if (request.argv is None) == (request.cmd is None):
            raise InvalidArgument("give exactly one of argv and cmd", sandbox_id=self._sandbox_id)
        if request.background and request.stdin is not None:
            raise InvalidArgument("a background exec takes no stdin", sandbox_id=self._sandbox_id)
        if request.follow and not request.background:
            raise InvalidArgument("follow needs background", sandbox_id=self._sandbox_id)
        if request.stdin is not None and (request.open_stdin or request.pty is not None):
            raise InvalidArgument(
                "stdin up front excludes open_stdin and pty", sandbox_id=self._sandbox_id
            )
        message: dict[str, object] = {
            "op": "exec",
            "env": dict(request.env),
            "user": request.user,
            "stdin": request.stdin is not None,
            "timeout_s": request.timeout_s,
            "background": request.background,
        }
        message |= {"argv": list(request.argv)} if request.argv is not None else {}
        message |= {"cmd": request.cmd} if request.cmd is not None else {}
        message |= {"cwd": request.cwd} if request.cwd is not None else {}
        message |= {"open_stdin": True} if request.open_stdin else {}
        message |= {"tag": request.tag} if request.tag is not None else {}
        message |= {"follow": True} if request.follow else {}
        if request.pty is not None:
            self._check_pty_size(request.pty)
            message["pty"] = {"rows": request.pty.rows, "cols": request.pty.cols}
        # A followed background exec streams as attach does: output, then its end.
        silent = request.background and not request.follow
        return await self._start_process(message, silent, request.stdin)

    async def attach(self, process: str | ProcessSelector) -> ExecStream:
        """Follow a background process: its buffered output (last 1 MiB), then live.

        ``process`` is its process id, or a ProcessSelector for the running one with a
        pid or a tag, found by the guest in the same request (E2B's Connect, issue 20).
        Raises InvalidArgument for a pid out of range or a tag outside the pattern (the
        guest checks them), NotFound when no such (running) process is there, and as
        ``exec`` otherwise.
        """
        message: dict[str, object] = {"op": "process.attach"}
        if isinstance(process, str):
            message["process_id"] = process
        elif process.pid is not None:  # ProcessSelector names exactly one
            message["pid"] = process.pid
        else:
            message["tag"] = process.tag
        expect_pid = None if isinstance(process, str) else process.pid
        return await self._start_process(message, False, None, expect_pid=expect_pid)

    async def _start_process(
        self,
        message: dict[str, object],
        silent: bool,
        stdin: bytes | None,
        *,
        expect_pid: int | None = None,
    ) -> ExecStream:
        """``silent``: a background exec's stream, which ends with its start (RESULT
        pid and process id, no DATA); otherwise output follows, then ExecExited.
        ``expect_pid``: the started event must name this pid (an attach by pid)."""
        parse_result: ResultParser = (
            (lambda m: parse.parse_started(m)) if silent else parse.parse_exited
        )

        def started(event: dict[str, object]) -> object:
            parse.expect_event(event, "started")
            fields = parse.parse_started_event(event)
            if expect_pid is not None and fields[0] != expect_pid:
                raise ProtocolError(f"asked for pid {expect_pid}, the guest started {fields[0]}")
            return fields

        stream = await self._open_stream(
            message, parse_result, started, max_events=1, accepts_data=not silent
        )

        async def start() -> tuple[int, str, bool]:
            started = await self._next_item(stream)
            assert isinstance(started, tuple)
            return int(started[0]), str(started[1]), bool(started[2])

        pid, process_id, pty = await self._call(stream, start)
        feeder = None
        if stdin is not None:  # fed alongside the output, so a pipe-full stdin cannot stall us
            feeder = asyncio.get_running_loop().create_task(self._feed_stdin(stream, stdin))

        async def abandon() -> None:
            if feeder is not None:
                feeder.cancel()
            await self._abandon(stream)

        return ChannelExecStream(
            pid,
            process_id,
            lambda: self._call(stream, lambda: self._next_item(stream)),
            abandon,
            silent,
            pty=pty,
        )

    async def _feed_stdin(self, stream: GuestStream, stdin: bytes) -> None:
        # A failure here shows up on the stream itself (its RESULT or the channel's end).
        with contextlib.suppress(NodeError, TimeoutError):
            await self._send_input(stream, [stdin])

    async def list_processes(self) -> list[ProcessInfo]:
        collected: list[ProcessInfo] = []

        def batch(message: dict[str, object]) -> None:
            parse.expect_event(message, "processes")
            items = parse.require_list(message, "processes", MAX_LIST_ITEMS - len(collected))
            collected.extend(parse.parse_process(item) for item in items)

        def result(message: dict[str, object]) -> list[ProcessInfo]:
            batch({"event": "processes", **message})
            return collected

        return await self._request({"op": "process.list"}, result, batch, max_events=MAX_LIST_ITEMS)

    async def kill_process(self, process_id: str, signal: int = 9) -> None:
        await self._request({"op": "process.kill", "process_id": process_id, "signal": signal}, _ok)

    async def write_stdin(self, process_id: str, data: bytes, *, eof: bool = False) -> int:
        """Write ``data`` to a process's stdin or terminal (then close it if ``eof``).

        Returns the bytes written, once the process took them. Raises InvalidArgument
        for more than MAX_INPUT_BYTES, NotFound (no such process), Conflict (exited,
        stdin closed or never open), Timeout (the process read nothing for 30 s, or the
        guest fell silent), Unavailable. Cancelling mid-way abandons the write: a part
        of ``data`` may have reached the process.
        """
        if len(data) > MAX_INPUT_BYTES:
            raise InvalidArgument(
                f"stdin of {len(data)} bytes exceeds {MAX_INPUT_BYTES} per call",
                sandbox_id=self._sandbox_id,
            )
        request = {"op": "process.input", "process_id": process_id, "eof": eof}
        stream = await self._open_stream(request, _bytes_result)
        try:
            await self._send_input(stream, [data] if data else [])
        except TimeoutError:
            await self._abandon(stream)
            raise self._silent("process.input") from None
        except BaseException:
            await asyncio.shield(self._abandon(stream))
            raise
        written = await self._call(stream, lambda: self._next_item(stream))
        assert isinstance(written, int)
        return written

    async def resize_pty(self, process_id: str, size: PtySize) -> None:
        """Set the window size of a process's PTY (the kernel sends it SIGWINCH)."""
        self._check_pty_size(size)
        request = {"op": "process.resize", "process_id": process_id}
        await self._request(request | {"rows": size.rows, "cols": size.cols}, _ok)

    def _check_pty_size(self, size: PtySize) -> None:
        for name, value in (("rows", size.rows), ("cols", size.cols)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgument(f"pty {name} must be an integer", sandbox_id=self._sandbox_id)
            if not 1 <= value <= MAX_PTY_SIZE:
                raise InvalidArgument(
                    f"pty {name} must be 1 to {MAX_PTY_SIZE}, got {value}",
                    sandbox_id=self._sandbox_id,
                )

    async def read_file(self, path: str, user: str = "user") -> FileReader:
        """Open a guest file for reading; returns once its Stat is known.

        Raises NotFound, PermissionDenied, InvalidArgument (a directory, a symlink, not a
        regular file), Timeout, Unavailable. Chunks follow as the reader is iterated;
        each wait lasts as long as the guest is alive (module docstring).
        """

        def stat_event(event: dict[str, object]) -> object:
            parse.expect_event(event, "stat")
            return parse.parse_stat(event.get("stat"))

        def size_result(message: dict[str, object]) -> object:
            return parse.require_int(message, "size")

        stream = await self._open_stream(
            {"op": "file.read", "path": path, "user": user},
            size_result,
            stat_event,
            max_events=1,
            accepts_data=True,
        )
        stat = await self._call(stream, lambda: self._next_item(stream))
        assert isinstance(stat, FileStat)
        return ChannelFileReader(
            stat,
            lambda: self._call(stream, lambda: self._next_item(stream)),
            lambda: self._abandon(stream),
        )

    async def write_file(
        self, path: str, data: AsyncIterable[bytes], *, user: str = "user", mode: int = 0o644
    ) -> FileStat:
        """Write a guest file atomically (temp file, fsync, rename) from ``data``.

        Streams as the guest's credit allows, so memory stays bounded. Cancelling (or an
        error in ``data``) abandons the write: the guest discards the temp file and the
        old content stays. Raises the guest's error, Timeout (the guest fell silent
        while we waited on it), Unavailable.
        """
        request = {"op": "file.write", "path": path, "user": user, "mode": mode}
        stream = await self._open_stream(request, _stat_result)
        try:
            async for chunk in data:
                if not isinstance(chunk, bytes | bytearray | memoryview):
                    raise InvalidArgument("write_file data must yield bytes")
                await self._send_chunk(stream, bytes(chunk))
                if stream.done:
                    break
            await self._send_input(stream, [])
        except TimeoutError:
            await self._abandon(stream)
            raise self._silent(f"writing {path}") from None
        except BaseException:
            await asyncio.shield(self._abandon(stream))
            raise
        value = await self._call(stream, lambda: self._next_item(stream))
        assert isinstance(value, FileStat)
        return value

    async def open_port(self, port: int) -> ChannelPortTunnel:
        """Connect, in the guest, to a server on ``port`` (127.0.0.1, else ::1) and relay
        it; returns once the connection is made (space.node.api.PortTunnel).

        Raises InvalidArgument for a port outside 1 to 65535, Unavailable when nothing
        listens there (``connection_refused``), ResourceExhausted past the guest's bound,
        Timeout, Unavailable. Every read and write waits as long as the guest is alive;
        each write is held to the guest's credit, as a file upload is.
        """
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidArgument(
                f"port must be 1 to 65535, got {port!r}", sandbox_id=self._sandbox_id
            )

        def connected(event: dict[str, object]) -> object:
            parse.expect_event(event, "connected")
            return port

        request = {"op": str(Op.PORT_CONNECT), "port": port}
        stream = await self._open_stream(
            request, lambda m: None, connected, max_events=1, accepts_data=True
        )
        stream.queues_eof = True
        await self._call(stream, lambda: self._next_item(stream))

        async def send(data: bytes) -> None:
            try:
                await self._send_chunk(stream, data)
            except TimeoutError:
                await self._abandon(stream)
                raise self._silent(f"port {port}") from None
            except BaseException:
                await asyncio.shield(self._abandon(stream))
                raise

        async def send_eof() -> None:
            try:
                await self._send_input(stream, [])
            except TimeoutError:
                await self._abandon(stream)
                raise self._silent(f"port {port}") from None

        return ChannelPortTunnel(
            port,
            lambda: self._call(stream, lambda: self._next_item(stream)),
            send,
            send_eof,
            lambda: self._abandon(stream),
        )

    async def watch_dir(
        self, path: str, *, recursive: bool = False, user: str = "user"
    ) -> ChannelWatchStream:
        """Watch a guest directory; returns once the guest's watches are in place.

        Raises NotFound (no such path), InvalidArgument (not a directory),
        ResourceExhausted (the guest's bounds), Timeout, Unavailable. Iterating waits
        for the next change as long as the guest is alive; ``aclose`` releases the watch.
        """

        def watching(event: dict[str, object]) -> object:
            parse.expect_event(event, "watching")
            return parse.require_str(event, "path", max_chars=4096)

        request = {"op": "file.watch", "path": path, "recursive": recursive, "user": user}
        stream = await self._open_stream(
            request, lambda m: None, watching, max_events=1, accepts_data=True
        )
        resolved = await self._call(stream, lambda: self._next_item(stream))
        assert isinstance(resolved, str)
        return ChannelWatchStream(
            resolved,
            lambda: self._call(stream, lambda: self._next_item(stream)),
            lambda: self._abandon(stream),
            self._fail,
            self._sandbox_id,
        )

    async def list_dir(self, path: str, user: str = "user") -> list[FileStat]:
        """Entries of a guest directory (lstat; at most 10,000)."""
        collected: list[FileStat] = []

        def batch(message: dict[str, object]) -> None:
            parse.expect_event(message, "entries")
            items = parse.require_list(message, "entries", MAX_LIST_ITEMS - len(collected))
            collected.extend(parse.parse_stat(item) for item in items)

        def result(message: dict[str, object]) -> list[FileStat]:
            batch({"event": "entries", "entries": message.get("entries")})
            return collected

        request = {"op": "file.list", "path": path, "user": user}
        return await self._request(request, result, batch, max_events=MAX_LIST_ITEMS)

    async def stat(self, path: str, user: str = "user") -> FileStat:
        request = {"op": "file.stat", "path": path, "user": user}
        return await self._request(request, _stat_result)

    async def make_dir(self, path: str, user: str = "user") -> FileStat:
        """mkdir -p; an existing directory is fine (idempotent)."""
        request = {"op": "file.mkdir", "path": path, "user": user}
        return await self._request(request, _stat_result)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._request({"op": "file.remove", "path": path, "recursive": recursive}, _ok)

    async def rename(self, src: str, dst: str, user: str = "user") -> FileStat:
        request = {"op": "file.rename", "src": src, "dst": dst, "user": user}
        return await self._request(request, _stat_result)

    async def system_info(self) -> dict[str, object]:
        return await self._request({"op": "system.info"}, _system_info)

    async def metrics(self) -> Metrics:
        """One sample of the guest's CPU, memory and disk (space.protocol.Metrics).

        A RESULT outside Metrics' bounds is a protocol violation: the channel closes and
        this raises Unavailable; also Timeout, or the guest's error. Read-only.
        """
        return await self._request({"op": str(Op.SYSTEM_METRICS)}, Metrics.from_result)

    async def set_identity(
        self,
        *,
        hostname: str | None = None,
        machine_id: str | None = None,
        entropy: bytes | None = None,
        time_ns: int | None = None,
    ) -> list[str]:
        """Give the guest a new identity: wall clock, RNG entropy, hostname, machine-id.

        Meant for right after the HELLO of a restored, forked or resumed VM, before any
        user request. ``time_ns`` is the wall clock in ns since the epoch (the guest's
        ends up behind it by the channel's latency); ``entropy`` is 32 to 512 bytes from
        a CSPRNG; see space.protocol.Identity for the other limits. The guest applies
        the clock first and stops at the first failure (what came before stays applied).

        Returns the names applied, in the guest's order (all of those given). Raises
        InvalidArgument for no or malformed arguments (nothing is sent), the guest's
        error (e.g. PermissionDenied), Timeout, Unavailable. Idempotent: sending the
        same values again changes nothing more (entropy is mixed in once more).
        """
        try:
            identity = Identity(
                hostname=hostname, machine_id=machine_id, entropy=entropy, time_ns=time_ns
            )
        except ProtocolError as exc:
            raise InvalidArgument(str(exc), sandbox_id=self._sandbox_id) from None
        requested = identity.fields()
        return await self._request(
            identity.to_request(), lambda message: parse.parse_applied(message, requested)
        )

    async def ping(self, timeout_s: float = 5.0) -> float:
        """Round trip to spaced in seconds; raises Timeout or Unavailable."""
        if self._closed:
            raise self._unavailable()
        token = secrets.token_bytes(8)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pings[token] = waiter
        started = time.monotonic()
        try:
            await self._send(FrameKind.PING, 0, token)
            async with asyncio.timeout(timeout_s):
                await waiter
        except TimeoutError:
            raise Timeout(f"no PONG within {timeout_s} s", sandbox_id=self._sandbox_id) from None
        finally:
            self._pings.pop(token, None)
        return time.monotonic() - started


def _ok(message: dict[str, object]) -> None:
    return None


def _bytes_result(message: dict[str, object]) -> int:
    written = parse.require_int(message, "bytes")
    if written is None or not 0 <= written <= MAX_INPUT_BYTES:
        raise ProtocolError("process.input answered a byte count out of range")
    return written


def _stat_result(message: dict[str, object]) -> FileStat:
    return parse.parse_stat(message.get("stat"))


def _system_info(message: dict[str, object]) -> dict[str, object]:
    info: dict[str, object] = {
        "hostname": parse.require_str(message, "hostname", max_chars=256),
        "boot_id": parse.require_str(message, "boot_id", max_chars=256),
        "uptime_s": parse.require_number(message, "uptime_s"),
        "agent": parse.require_str(message, "agent", max_chars=256),
        # Absent from older guests, which have no spawner helper to wait for.
        "spawner_starting": message.get("spawner_starting") is True,
    }
    return info
