"""Running processes in a sandbox: ``sandbox.commands`` (async core)."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

from space.limits import ENV
from space.sdk._events import (
    OutputCallback,
    OutputCollector,
    StartEvent,
    iter_events,
    parse_start,
    read_events,
)
from space.sdk._http import ApiClient
from space.sdk._models import CommandResult, ProcessInfo
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

        Raises NotFound (sandbox), InvalidArgument (bad cwd, user, non-UTF-8 stdin),
        Unavailable (VM or API down), and the other SpaceError leaves.
        """
        body = _exec_body(cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s)
        path = f"/v1/sandboxes/{self._sandbox_id}/exec"
        if background:
            return await self._start_background(path, {**body, "background": True})
        result = await _stream_to_result(
            self._api,
            "POST",
            path,
            body=body,
            sandbox_id=self._sandbox_id,
            operation="commands.run",
            deadline_after_start_s=timeout_s + _CLIENT_GRACE_S if timeout_s else None,
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

    async def connect(self, process_id: str) -> AsyncCommandHandle:
        """A handle on an existing process (to ``wait`` on or ``kill``); NotFound if none."""
        for process in await self.list():
            if process.process_id == process_id:
                return AsyncCommandHandle(
                    self._api, self._sandbox_id, pid=process.pid, process_id=process_id
                )
        raise NotFound(
            f"no process {process_id!r}", sandbox_id=self._sandbox_id, operation="commands.connect"
        )

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
) -> CommandResult:
    """Read an exec or attach stream to its end; Timeout past ``deadline_s`` (counted
    from the call) or ``deadline_after_start_s`` (counted from the ``start`` event).

    Without either, each wait is bounded by _STREAM_READ_TIMEOUT_S only.
    """
    started: list[StartEvent] = []
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(deadline_s) as deadline:

            def on_start(start: StartEvent) -> None:
                started.append(start)
                if deadline_after_start_s is not None:
                    when, current = loop.time() + deadline_after_start_s, deadline.when()
                    deadline.reschedule(when if current is None else min(when, current))

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
                    on_start=on_start,
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
