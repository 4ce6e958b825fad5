"""envd's ``process.Process`` service, translated to our guest's process operations.

E2B names a process by its pid (or a tag); we name it by a process id. Every process is
started as our *background* process whose output the same guest request streams
(``follow``: one round trip, issue 20): as in envd, a process outlives the stream that
started it (a client that goes away leaves it running; ``Connect`` attaches again), and
the stream's deadline (``Connect-Timeout-Ms``) is the process's timeout. Only running
processes are found by pid or tag, so signalling one that has ended answers not_found
(the SDK's ``kill`` then returns False).

- Start: exec (background and follow, ``open_stdin`` for ``stdin``, ``pty``, ``tag``).
- Connect: attach by pid or tag (the guest finds the process, one request). List:
  processes, running only. SendInput, StreamInput: write_stdin.
- CloseStdin: write_stdin(eof). SendSignal: kill_process. Update: resize_pty.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from space.control.e2b.connect import Code, ConnectError, Fields, b64
from space.limits import (
    ENV,
    MAX_COMMAND_TIMEOUT_S,
    MAX_PROCESS_PID,
    MAX_PTY_SIZE,
    MAX_STDIN_BYTES,
    PROCESS_TAG_PATTERN,
)
from space.node.api import (
    ExecExited,
    ExecRequest,
    ExecStream,
    NodeService,
    NotFound,
    ProcessInfo,
    ProcessSelector,
    PtySize,
)

__all__ = ["KILL_WAIT_S", "ProcessService"]

_SIGKILL = 9
_SIGNALS = {"SIGNAL_UNSPECIFIED": 0, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": _SIGKILL}
#: Longest a SIGKILL waits for the process to be gone before it answers.
KILL_WAIT_S = 2.0
_MAX_ARGS = 4096
_TAG_RE = re.compile(PROCESS_TAG_PATTERN)
_GO_SIGNAL_NAMES = {9: "killed", 15: "terminated", 2: "interrupt", 1: "hangup"}


def _event(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"event": {kind: body}}


#: A server-streamed process's idle message.
KEEPALIVE = _event("keepalive", {})


def _end_event(exited: ExecExited) -> dict[str, Any]:
    """envd's end event: Go's ProcessState words (``exit status 1``, ``signal:
    killed``), exit code -1 for a process a signal ended."""
    if exited.exit_code is not None:
        status = f"exit status {exited.exit_code}"
        return _event("end", {"exitCode": exited.exit_code, "exited": True, "status": status})
    name = _GO_SIGNAL_NAMES.get(exited.signal or 0, f"signal {exited.signal}")
    return _event("end", {"exitCode": -1, "exited": False, "status": f"signal: {name}"})


@dataclass
class ProcessService:
    node: NodeService
    sandbox_id: str
    #: The user E2B's Authorization header names.
    user: str
    #: The stream's deadline from Connect-Timeout-Ms (None: none).
    timeout_s: float | None

    async def start(self, fields: Fields) -> AsyncIterator[dict[str, Any]]:
        request = self._exec_request(fields)
        stream = await self.node.exec(self.sandbox_id, request)
        async for message in _events(stream, pty=request.pty is not None):
            yield message

    def _exec_request(self, fields: Fields) -> ExecRequest:
        config = fields.sub("process")
        if config is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "process is required")
        cmd = config.string("cmd", max_chars=65536)
        if not cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd must not be empty")
        envs = config.string_map("envs", max_items=ENV.entries)
        why = ENV.refusal("process.envs", envs)
        if why is not None:
            raise ConnectError(Code.INVALID_ARGUMENT, why)
        tag = fields.string("tag", max_chars=64) if fields.has("tag") else None
        if tag is not None and not _TAG_RE.fullmatch(tag):
            raise ConnectError(Code.INVALID_ARGUMENT, f"tag must match {PROCESS_TAG_PATTERN}")
        pty = _pty_size(fields)
        timeout_s = self.timeout_s if self.timeout_s else None
        if timeout_s is not None:
            timeout_s = min(timeout_s, MAX_COMMAND_TIMEOUT_S)
        return ExecRequest(
            argv=[cmd, *config.strings("args", max_items=_MAX_ARGS)],
            env=envs,
            cwd=config.string("cwd") or None,
            user=self.user,
            timeout_s=timeout_s,
            background=True,
            follow=True,
            open_stdin=fields.boolean("stdin") and pty is None,
            pty=pty,
            tag=tag,
        )

    async def connect(self, fields: Fields) -> AsyncIterator[dict[str, Any]]:
        # The guest finds the running process by pid or tag and follows it in the same
        # request (one round trip, not list then attach: issue 20).
        pid, tag = _selector(fields)
        try:
            stream = await self.node.attach(self.sandbox_id, ProcessSelector(pid=pid, tag=tag))
        except NotFound:
            raise ConnectError(Code.NOT_FOUND, _not_found(pid, tag)) from None
        async for message in _events(stream, pty=stream.pty):
            yield message

    async def list(self, fields: Fields) -> dict[str, Any]:
        infos = await self.node.list_processes(self.sandbox_id)
        return {"processes": [_process_info(info) for info in infos if info.running]}

    async def send_input(self, fields: Fields) -> dict[str, Any]:
        info = await self._select(fields)
        await self._write(info, fields.sub("input"))
        return {}

    async def stream_input(self, messages: AsyncIterator[Fields]) -> dict[str, Any]:
        """``start`` (the process) first, then ``data`` and ``keepalive`` in any order."""
        info: ProcessInfo | None = None
        async for message in messages:
            event = message.oneof("start", "data", "keepalive")
            if event is None or event[0] == "keepalive":
                continue
            body = message.sub(event[0])
            assert body is not None  # oneof() returned it as set
            if event[0] == "start":
                info = await self._select(body)
            elif info is None:
                raise ConnectError(Code.INVALID_ARGUMENT, "data came before start")
            else:
                await self._write(info, body.sub("input"))
        return {}

    async def close_stdin(self, fields: Fields) -> dict[str, Any]:
        info = await self._select(fields)
        await self.node.write_stdin(self.sandbox_id, info.process_id, b"", eof=True)
        return {}

    async def send_signal(self, fields: Fields) -> dict[str, Any]:
        signal = fields.enum("signal", _SIGNALS)
        if signal == 0:
            raise ConnectError(Code.INVALID_ARGUMENT, "signal must be SIGTERM or SIGKILL")
        info = await self._select(fields)
        await self.node.kill_process(self.sandbox_id, info.process_id, signal)
        if signal == _SIGKILL:
            await self._gone(info.process_id)
        return {}

    async def _gone(self, process_id: str) -> None:
        """Wait (at most KILL_WAIT_S) until the guest has reaped the process, so that a
        List or a second kill right after a SIGKILL no longer finds it, as with envd."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(KILL_WAIT_S):
                while True:
                    infos = await self.node.list_processes(self.sandbox_id)
                    if not any(i.process_id == process_id and i.running for i in infos):
                        return
                    await asyncio.sleep(0.05)

    async def update(self, fields: Fields) -> dict[str, Any]:
        info = await self._select(fields)
        size = _pty_size(fields)
        if size is not None:
            await self.node.resize_pty(self.sandbox_id, info.process_id, size)
        return {}

    async def _write(self, info: ProcessInfo, given: Fields | None) -> None:
        member = None if given is None else given.oneof("stdin", "pty")
        if given is None or member is None:
            return
        data = given.data(member[0], max_bytes=MAX_STDIN_BYTES)
        if data:
            await self.node.write_stdin(self.sandbox_id, info.process_id, data)

    async def _select(self, fields: Fields) -> ProcessInfo:
        """The running process ``process`` (a ProcessSelector: pid or tag) names."""
        pid, tag = _selector(fields)
        for info in await self.node.list_processes(self.sandbox_id):
            if info.running and (info.pid == pid if tag is None else info.tag == tag):
                return info
        raise ConnectError(Code.NOT_FOUND, _not_found(pid, tag))


def _selector(fields: Fields) -> tuple[int | None, str | None]:
    """(pid, tag) of the ProcessSelector ``process``: exactly one is set."""
    selector = fields.sub("process")
    chosen = None if selector is None else selector.oneof("pid", "tag")
    if selector is None or chosen is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "process must give a pid or a tag")
    if chosen[0] == "pid":
        pid = selector.integer("pid")
        if not 1 <= pid <= MAX_PROCESS_PID:  # no process has it: as envd, not found
            raise ConnectError(Code.NOT_FOUND, _not_found(pid, None))
        return pid, None
    tag = selector.string("tag", max_chars=64)
    if not _TAG_RE.fullmatch(tag):  # no process can have it (Start refuses it)
        raise ConnectError(Code.NOT_FOUND, _not_found(None, tag))
    return None, tag


def _not_found(pid: int | None, tag: str | None) -> str:
    what = f"pid {pid}" if tag is None else f"tag {tag!r}"
    return f"process with {what} not found"


def _pty_size(fields: Fields) -> PtySize | None:
    pty = fields.sub("pty")
    size = None if pty is None else pty.sub("size")
    if size is None:
        return None
    return PtySize(
        rows=size.integer("rows", low=1, high=MAX_PTY_SIZE),
        cols=size.integer("cols", low=1, high=MAX_PTY_SIZE),
    )


def _process_info(info: ProcessInfo) -> dict[str, Any]:
    argv = info.argv or ["/bin/bash", "-l", "-c", info.cmd or ""]
    body: dict[str, Any] = {
        "config": {"cmd": argv[0], "args": argv[1:], "envs": {}},
        "pid": info.pid,
    }
    if info.tag is not None:
        body["tag"] = info.tag
    return body


async def _events(stream: ExecStream, *, pty: bool) -> AsyncIterator[dict[str, Any]]:
    """The start event, output as data events, and the end event (a process our guest
    killed at its timeout ends the stream with deadline_exceeded instead, as envd's
    deadline does). Closing the iterator detaches: the process keeps running."""
    try:
        yield _event("start", {"pid": stream.pid})
        async for event in stream:
            if isinstance(event, ExecExited):
                if event.timed_out:
                    raise ConnectError(Code.DEADLINE_EXCEEDED, "the process reached its timeout")
                yield _end_event(event)
                return
            channel = "pty" if pty else event.stream
            yield _event("data", {channel: b64(event.data)})
    finally:
        await stream.aclose()
