"""Running processes in a sandbox: ``sandbox.commands`` (async core).

A process started with ``open_stdin=True`` or ``pty=PtySize(...)`` takes input later
(``send_stdin``, ``close_stdin``; E2B's ``commands.send_stdin``); a PTY process's
output is one stream (``stdout``) and its window is changed with ``resize_pty``
(issue 20). Each input call is one HTTP request answered once the process took the
bytes: a keystroke reaches the process in about one round trip to the API.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

from space.limits import ENV, MAX_STDIN_BYTES
from space.sdk._events import (
    OutputCallback,
    OutputCollector,
    StartEvent,
    iter_events,
    parse_start,
    read_events,
)
from space.sdk._http import ApiClient
from space.sdk._models import CommandResult, ProcessInfo, PtySize
from space.sdk._sandbox_requests import bounded_map
from space.sdk.errors import (
    CommandExitError,
    InternalError,
    InvalidArgument,
    NotFound,
    Timeout,
)

__all__ = ["AsyncCommandHandle", "AsyncCommands"]

#: Default ``timeout_s`` of a command (E2B's default too); None disables it.
DEFAULT_COMMAND_TIMEOUT_S = 60.0
#: How long past the command's own timeout, counted from its start, the client waits for
#: the server to report its end (the guest kills it at ``timeout_s``; the report then
#: crosses a node that may be loaded).
_CLIENT_GRACE_S = 30.0
#: Output kept in a CommandResult per stream; callbacks see everything regardless.
MAX_OUTPUT_BYTES = 32 << 20
#: The SDK's own bound on each wait of an exec or attach stream (its answer, each next
#: line, a free connection of the pool) where no deadline of the caller applies. Only
#: against a hung API: the node waits for a busy guest as long as the guest is alive and
#: answers Timeout (504) once it falls silent, so a shorter client bound would fail
#: execs that are merely queued behind a busy guest (issue 15).
_STREAM_READ_TIMEOUT_S = 24 * 3600.0
#: Most stdin bytes one request carries (the API's cap, space.protocol.MAX_INPUT_BYTES);
#: more is sent as several requests, in order.
MAX_STDIN_CHUNK_BYTES = MAX_STDIN_BYTES
#: Bound on one stdin request: the guest waits up to 30 s for the process to read, and
#: the node as long as a busy guest is alive.
_STDIN_TIMEOUT_S = 120.0
#: Called with the process's handle once it started (for input to a foreground run).
StartCallback = Callable[["AsyncCommandHandle"], object]


class AsyncCommandHandle:
    """A background process: wait for it, stream its output again, or kill it."""

    def __init__(self, api: ApiClient, sandbox_id: str, *, pid: int, process_id: str) -> None:
        self._api = api
        self.sandbox_id = sandbox_id
        self.pid = pid
        self.process_id = process_id

    def __repr__(self) -> str:
        return f"<AsyncCommandHandle {self.sandbox_id}/{self.process_id} pid={self.pid}>"

    async def wait(
        self,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        timeout_s: float | None = None,
        check: bool = False,
    ) -> CommandResult:
        """Attach to the process and wait for it to end.

        The server replays the output buffered so far, then streams live, so callbacks
        and the result hold everything the process printed. ``timeout_s`` bounds the wait
        (None: as long as the process runs, which its own ``timeout_s`` limits); passing
        it raises Timeout and leaves the process running. Raises CommandExitError on an
        unsuccessful end when ``check`` is true.
        """
        path = f"/v1/sandboxes/{self.sandbox_id}/processes/{self.process_id}/stream"
        result = await _stream_to_result(
            self._api,
            "GET",
            path,
            body=None,
            sandbox_id=self.sandbox_id,
            operation="commands.wait",
            deadline_s=timeout_s,
            collector=OutputCollector(
                on_stdout=on_stdout, on_stderr=on_stderr, max_bytes=MAX_OUTPUT_BYTES
            ),
        )
        return _checked(result, check=check, sandbox_id=self.sandbox_id)

    async def kill(self, signal: int = 9) -> bool:
        """Send ``signal`` to the process. False if it is already gone; idempotent."""
        return await _kill(self._api, self.sandbox_id, self.process_id, signal)

    async def send_stdin(self, data: str | bytes) -> None:
        """Write ``data`` (text as UTF-8) to the process's stdin or terminal; see
        AsyncCommands.send_stdin."""
        await _send_stdin(self._api, self.sandbox_id, self.process_id, data, eof=False)

    async def close_stdin(self) -> None:
        """Close the process's stdin (a PTY gets Ctrl-D); see AsyncCommands.close_stdin."""
        await _send_stdin(self._api, self.sandbox_id, self.process_id, b"", eof=True)

    async def resize(self, size: PtySize) -> None:
        """Change the window of the process's PTY; see AsyncCommands.resize_pty."""
        await _resize(self._api, self.sandbox_id, self.process_id, size)


class AsyncCommands:
    """``sandbox.commands``: run commands and manage the processes they start."""

    def __init__(self, api: ApiClient, sandbox_id: str) -> None:
        self._api = api
        self._sandbox_id = sandbox_id

    @overload
    async def run(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout_s: float | None = DEFAULT_COMMAND_TIMEOUT_S,
        background: Literal[False] = False,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        check: bool = False,
        open_stdin: bool = False,
        pty: PtySize | None = None,
        tag: str | None = None,
        on_start: StartCallback | None = None,
    ) -> CommandResult: ...

    @overload
    async def run(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout_s: float | None = DEFAULT_COMMAND_TIMEOUT_S,
        background: Literal[True],
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        check: bool = False,
        open_stdin: bool = False,
        pty: PtySize | None = None,
        tag: str | None = None,
        on_start: StartCallback | None = None,
    ) -> AsyncCommandHandle: ...

    async def run(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout_s: float | None = DEFAULT_COMMAND_TIMEOUT_S,
        background: bool = False,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        check: bool = False,
        open_stdin: bool = False,
        pty: PtySize | None = None,
        tag: str | None = None,
        on_start: StartCallback | None = None,
    ) -> CommandResult | AsyncCommandHandle:
        """Run ``cmd`` (a shell string, or an argv list spawned without a shell).

        Foreground: streams output to ``on_stdout``/``on_stderr`` (decoded text chunks,
        in order) and returns the CommandResult; ``check=True`` raises CommandExitError
        when it did not exit 0. ``timeout_s`` bounds the command's run, from its start
        in the guest, and is enforced there (the result then has ``timed_out``); the
        client gives up with Timeout 30 s past it, counted from the start. The wait for
        the start has no deadline of the client's: a busy guest may start the command
        late, and the server answers Timeout only if the guest stops responding. Wrap
        the call in ``asyncio.timeout`` for a bound of your own. Cancelling mid-way
        closes the stream and the server kills the process.

        Background: returns an AsyncCommandHandle once the process has started; the
        process keeps running until it ends, its ``timeout_s`` passes, or it is killed.

        ``open_stdin`` keeps stdin open for ``send_stdin`` until ``close_stdin`` (or the
        process's end); ``pty`` runs the command on a pseudo-terminal of that size (its
        output all ``stdout``, input through ``send_stdin``, a ``"\x03"`` is Ctrl-C);
        both exclude ``stdin``. ``tag`` labels the process (1 to 64 of
        ``[A-Za-z0-9_.:-]``) for ``list`` and ``connect(tag=...)``. ``on_start`` is called
        with the process's handle once it runs (on the event loop: it must not block),
        so a foreground run can be fed input.

        Raises NotFound (sandbox), InvalidArgument (bad cwd, user, tag or PTY size,
        non-UTF-8 stdin), Unavailable (VM or API down), and the other SpaceError leaves.
        """
        body = _exec_body(cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s)
        body |= _interactive_fields(open_stdin=open_stdin, pty=pty, tag=tag)
        path = f"/v1/sandboxes/{self._sandbox_id}/exec"
        if background:
            handle = await self._start_background(path, {**body, "background": True})
            if on_start is not None:
                on_start(handle)
            return handle

        def started(start: StartEvent) -> None:
            if on_start is not None:
                on_start(self._handle(start.pid, start.process_id))

        result = await _stream_to_result(
            self._api,
            "POST",
            path,
            body=body,
            sandbox_id=self._sandbox_id,
            operation="commands.run",
            deadline_after_start_s=timeout_s + _CLIENT_GRACE_S if timeout_s else None,
            on_start=started,
            collector=OutputCollector(
                on_stdout=on_stdout, on_stderr=on_stderr, max_bytes=MAX_OUTPUT_BYTES
            ),
        )
        return _checked(result, check=check, sandbox_id=self._sandbox_id)

    async def list(self) -> builtins.list[ProcessInfo]:
        """Processes started in this sandbox (running and recently finished)."""
        body = await self._api.request_json(
            "GET",
            f"/v1/sandboxes/{self._sandbox_id}/processes",
            operation="commands.list",
            sandbox_id=self._sandbox_id,
        )
        if not isinstance(body, dict) or not isinstance(body.get("processes"), builtins.list):
            raise InternalError("malformed process list", sandbox_id=self._sandbox_id)
        return [ProcessInfo.from_wire(p) for p in body["processes"]]

    async def kill(self, process_id: str, signal: int = 9) -> bool:
        """Send ``signal`` to a process. False if no such process; idempotent."""
        return await _kill(self._api, self._sandbox_id, process_id, signal)

    async def connect(
        self, process_id: str | None = None, *, tag: str | None = None
    ) -> AsyncCommandHandle:
        """A handle on an existing process (to ``wait`` on, ``kill``, feed), by id or by
        ``tag`` (the newest running one with it, else the newest); NotFound if none."""
        if (process_id is None) == (tag is None):
            raise InvalidArgument("give exactly one of process_id and tag", operation="connect")
        found = [
            p
            for p in await self.list()
            if p.process_id == process_id or (tag is not None and p.tag == tag)
        ]
        found.sort(key=lambda p: p.running)  # the list is oldest first; running ones last
        if found:
            return self._handle(found[-1].pid, found[-1].process_id)
        what = f"process {process_id!r}" if tag is None else f"process tagged {tag!r}"
        raise NotFound(f"no {what}", sandbox_id=self._sandbox_id, operation="commands.connect")

    async def send_stdin(self, process_id: str, data: str | bytes) -> None:
        """Write ``data`` (text as UTF-8) to the stdin or terminal of a process started
        with ``open_stdin`` or ``pty``; returns once the process took it.

        Data over 1 MiB goes as several requests, in order; concurrent calls for one
        process may interleave between those pieces only. Raises NotFound (no such
        process), Conflict (it has exited, its stdin is closed or was never open),
        Timeout (it read nothing for 30 s). Not idempotent: a retry writes again.
        """
        await _send_stdin(self._api, self._sandbox_id, process_id, data, eof=False)

    async def close_stdin(self, process_id: str) -> None:
        """Close the process's stdin (EOF); a PTY gets Ctrl-D. Conflict if already closed."""
        await _send_stdin(self._api, self._sandbox_id, process_id, b"", eof=True)

    async def resize_pty(self, process_id: str, size: PtySize) -> None:
        """Change the window of a PTY process (it gets SIGWINCH); Conflict if it has no
        PTY or has exited, InvalidArgument for a size out of 1-1000. Idempotent."""
        await _resize(self._api, self._sandbox_id, process_id, size)

    def _handle(self, pid: int, process_id: str) -> AsyncCommandHandle:
        return AsyncCommandHandle(self._api, self._sandbox_id, pid=pid, process_id=process_id)

    async def _start_background(self, path: str, body: dict[str, Any]) -> AsyncCommandHandle:
        async with self._api.stream(
            "POST",
            path,
            operation="commands.run",
            sandbox_id=self._sandbox_id,
            json_body=body,
            timeout_s=_STREAM_READ_TIMEOUT_S,  # the start may queue behind a busy guest
        ) as response:
            async for event in iter_events(response):
                if event["type"] == "start":
                    start = parse_start(event)
                    return AsyncCommandHandle(
                        self._api, self._sandbox_id, pid=start.pid, process_id=start.process_id
                    )
        raise InternalError(
            "background exec answered without a start event",
            sandbox_id=self._sandbox_id,
            operation="commands.run",
        )


def _exec_body(
    cmd: str | Sequence[str],
    *,
    env: Mapping[str, str] | None,
    cwd: str | None,
    user: str | None,
    stdin: str | bytes | None,
    timeout_s: float | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"cmd": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
    if env:
        body["env"] = bounded_map(ENV, "env", env, "commands.run")
    if cwd is not None:
        body["cwd"] = cwd
    if user is not None:
        body["user"] = user
    if stdin is not None:
        body["stdin"] = _stdin_text(stdin)
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    return body


def _interactive_fields(
    *, open_stdin: bool, pty: PtySize | None, tag: str | None
) -> dict[str, Any]:
    fields: dict[str, Any] = {"open_stdin": True} if open_stdin else {}
    if pty is not None:
        fields["pty"] = {"rows": pty.rows, "cols": pty.cols}
    if tag is not None:
        fields["tag"] = tag
    return fields


async def _send_stdin(
    api: ApiClient, sandbox_id: str, process_id: str, data: str | bytes, *, eof: bool
) -> None:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    step = MAX_STDIN_CHUNK_BYTES
    pieces = [raw[at : at + step] for at in range(0, len(raw), step)] or [b""]
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        await api.request_json(
            "POST",
            f"/v1/sandboxes/{sandbox_id}/processes/{process_id}/stdin",
            operation="commands.close_stdin" if eof else "commands.send_stdin",
            sandbox_id=sandbox_id,
            content=piece,
            params={"eof": "true" if eof and last else "false"},
            timeout_s=_STDIN_TIMEOUT_S,
        )


async def _resize(api: ApiClient, sandbox_id: str, process_id: str, size: PtySize) -> None:
    await api.request_json(
        "POST",
        f"/v1/sandboxes/{sandbox_id}/processes/{process_id}/resize",
        operation="commands.resize_pty",
        sandbox_id=sandbox_id,
        json_body={"rows": size.rows, "cols": size.cols},
    )


def _stdin_text(stdin: str | bytes) -> str:
    # docs/api.md carries stdin as text, so bytes must be UTF-8.
    if isinstance(stdin, str):
        return stdin
    try:
        return stdin.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(
            "stdin bytes must be UTF-8 (the API carries stdin as text)",
            operation="commands.run",
        ) from None


async def _stream_to_result(
    api: ApiClient,
    method: str,
    path: str,
    *,
    body: dict[str, Any] | None,
    sandbox_id: str,
    operation: str,
    collector: OutputCollector,
    deadline_s: float | None = None,
    deadline_after_start_s: float | None = None,
    on_start: Callable[[StartEvent], None] | None = None,
) -> CommandResult:
    """Read an exec or attach stream to its end; Timeout past ``deadline_s`` (counted
    from the call) or ``deadline_after_start_s`` (counted from the ``start`` event).

    Without either, each wait is bounded by _STREAM_READ_TIMEOUT_S only.
    """
    started: list[StartEvent] = []
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(deadline_s) as deadline:

            def at_start(start: StartEvent) -> None:
                started.append(start)
                if deadline_after_start_s is not None:
                    when, current = loop.time() + deadline_after_start_s, deadline.when()
                    deadline.reschedule(when if current is None else min(when, current))
                if on_start is not None:
                    on_start(start)

            async with api.stream(
                method,
                path,
                operation=operation,
                sandbox_id=sandbox_id,
                json_body=body,
                timeout_s=_STREAM_READ_TIMEOUT_S,
            ) as response:
                return await read_events(
                    iter_events(response),
                    collector,
                    on_start=at_start,
                    sandbox_id=sandbox_id,
                    operation=operation,
                )
    except TimeoutError:
        raise _no_end(started, deadline_s, deadline_after_start_s, sandbox_id, operation) from None


def _no_end(
    started: list[StartEvent],
    deadline_s: float | None,
    deadline_after_start_s: float | None,
    sandbox_id: str,
    operation: str,
) -> Timeout:
    limit, since = deadline_s, "of the call"
    if started and deadline_after_start_s is not None:
        limit, since = deadline_after_start_s, "of its start"
    process = f" (process {started[0].process_id})" if started else ""
    return Timeout(
        f"no end of the command within {limit} s {since}{process}",
        sandbox_id=sandbox_id,
        operation=operation,
        details={"timeout_s": limit},
    )


def _checked(result: CommandResult, *, check: bool, sandbox_id: str) -> CommandResult:
    if check and not result.ok:
        raise CommandExitError(result, sandbox_id=sandbox_id)
    return result


async def _kill(api: ApiClient, sandbox_id: str, process_id: str, signal: int) -> bool:
    try:
        await api.request_json(
            "POST",
            f"/v1/sandboxes/{sandbox_id}/processes/{process_id}/kill",
            operation="commands.kill",
            sandbox_id=sandbox_id,
            json_body={"signal": signal},
        )
    except NotFound:
        return False
    return True
