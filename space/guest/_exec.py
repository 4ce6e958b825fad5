"""Operation handlers for processes: exec, process.list, process.attach, process.kill,
process.input and process.resize (docs/protocol.md, "Requests").

An exec with ``background`` and ``follow`` starts a background process and then serves
its stream as process.attach does, so starting and reading one takes one request (E2B's
Start, issue 20); cancelling that stream detaches, the process runs on. process.attach
names its process by ``process_id``, or by ``pid`` or ``tag`` among the running ones, so
E2B's Connect is one request too."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re

from space.protocol import (
    DATA_CHUNK_BYTES,
    MAX_INPUT_BYTES,
    MAX_PID,
    MAX_PTY_SIZE,
    MAX_TAG_CHARS,
    TAG_PATTERN,
    Channel,
    ErrorCode,
)

from ._errors import OpError
from ._processes import (
    DRAIN_IDLE_S,
    ExecSpec,
    ManagedProcess,
    ProcessTable,
    Spawned,
    default_env,
    exit_fields,
    kill_group,
    new_process_id,
    spawn,
)
from ._request import Accounts, Fields
from ._session import Stream, send_batches
from ._stdio import FdSource, ProcessIo

__all__ = [
    "op_attach",
    "op_exec",
    "op_input",
    "op_kill",
    "op_list",
    "op_resize",
    "parse_exec",
]

#: Bound on the total characters of argv or cmd (so a process listing entry fits a message).
MAX_COMMAND_CHARS = 32 * 1024


def parse_exec(fields: Fields, accounts: Accounts) -> ExecSpec:
    account = accounts.get(fields)
    argv = fields.string_list("argv")
    cmd = fields.optional_string("cmd")
    if (argv is None) == (cmd is None):
        raise OpError(ErrorCode.INVALID_ARGUMENT, "give exactly one of argv and cmd")
    command = ["/bin/sh", "-c", cmd] if cmd is not None else argv
    assert command is not None
    if sum(len(arg) for arg in command) > MAX_COMMAND_CHARS:
        raise OpError(ErrorCode.INVALID_ARGUMENT, f"command longer than {MAX_COMMAND_CHARS}")
    cwd_field = fields.optional_string("cwd")
    cwd = account.resolve(cwd_field) if cwd_field is not None else account.home
    if not os.path.isdir(cwd):
        code = ErrorCode.NOT_A_DIRECTORY if os.path.exists(cwd) else ErrorCode.NOT_FOUND
        raise OpError(code, f"working directory {cwd!r} is not a directory")
    stdin = fields.boolean("stdin", False)
    open_stdin = fields.boolean("open_stdin", False)
    pty = _pty_size(fields)
    if stdin and (open_stdin or pty is not None):
        raise OpError(ErrorCode.INVALID_ARGUMENT, "stdin up front excludes open_stdin and pty")
    return ExecSpec(
        argv=command,
        cmd=cmd,
        env=default_env(account) | fields.string_dict("env"),
        cwd=cwd,
        account=account,
        stdin=stdin,
        timeout_s=fields.optional_seconds("timeout_s"),
        background=fields.boolean("background", False),
        open_stdin=open_stdin,
        pty=pty,
        tag=_tag(fields),
    )


def _pty_size(fields: Fields) -> tuple[int, int] | None:
    if fields.mapping().get("pty") is None:
        return None
    size = Fields(fields.object("pty"))
    rows = size.integer("rows", 24, low=1, high=MAX_PTY_SIZE)
    cols = size.integer("cols", 80, low=1, high=MAX_PTY_SIZE)
    return rows, cols


def _tag(fields: Fields) -> str | None:
    tag = fields.optional_string("tag", max_chars=MAX_TAG_CHARS)
    if tag is not None and not re.fullmatch(TAG_PATTERN, tag):
        raise OpError(ErrorCode.INVALID_ARGUMENT, f"tag must match {TAG_PATTERN}")
    return tag


def _started(process_id: str, pid: int, pty: bool) -> dict[str, object]:
    return {"event": "started", "pid": pid, "process_id": process_id, "pty": pty}


async def op_exec(
    stream: Stream, fields: Fields, accounts: Accounts, table: ProcessTable
) -> dict[str, object]:
    spec = parse_exec(fields, accounts)
    follow = fields.boolean("follow", False)
    if follow and not spec.background:
        raise OpError(ErrorCode.INVALID_ARGUMENT, "follow needs background")
    if spec.background:
        table.reserve()
    proc, io = await spawn(spec, table.spawners)
    process_id = new_process_id()
    if spec.background:
        managed = ManagedProcess(process_id, spec, proc, io)
        table.add(managed)
        if follow:  # subscribed before the loop runs its pumps: no output is missed
            return await _follow(stream, managed)
        await stream.send_event(_started(process_id, proc.pid, spec.pty is not None))
        return {"ok": True, "process_id": process_id, "pid": proc.pid}
    completed = False
    table.foreground[process_id] = proc
    table.foreground_io[process_id] = io
    try:
        await stream.send_event(_started(process_id, proc.pid, spec.pty is not None))
        result = await _run_foreground(stream, proc, io, spec)
        completed = True
        return result
    finally:
        del table.foreground[process_id]
        del table.foreground_io[process_id]
        io.release()
        if not completed:  # cancelled by the host or the session ended
            kill_group(proc.pid)


async def _run_foreground(
    stream: Stream, proc: Spawned, io: ProcessIo, spec: ExecSpec
) -> dict[str, object]:
    stream.on_signal = lambda signum: kill_group(proc.pid, signum)
    feeder = asyncio.create_task(_feed(stream, proc.stdin)) if spec.stdin and proc.stdin else None
    try:
        timed_out = await _relay(stream, proc, io, spec.timeout_s)
    finally:
        if feeder is not None:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
    if io.pty:  # one stream: the ERROR channel ends empty, as a client expects both ends
        await stream.send_eof(Channel.ERROR)
    exit_code, signum = exit_fields(proc.returncode)
    return {"ok": True, "exit_code": exit_code, "signal": signum, "timed_out": timed_out}


async def _relay(stream: Stream, proc: Spawned, io: ProcessIo, timeout_s: float | None) -> bool:
    """Send the output as it comes until the process has exited and its pipes are at EOF,
    or, once it has exited, until DRAIN_IDLE_S pass with no output (a grandchild may
    hold the pipes forever). On timeout the process group is killed. Returns whether
    it timed out.

    One coroutine, reading each pipe before any wait (a quick process has often ended
    by the time it is looked at): no task per pipe, and no loop turn for pipes already
    at EOF. Under TCG every bytecode and loop turn is emulated (issue 21).
    """
    loop = asyncio.get_running_loop()
    timed_out = False

    def time_out() -> None:
        nonlocal timed_out
        timed_out = True
        kill_group(proc.pid)

    timer = loop.call_later(timeout_s, time_out) if timeout_s is not None else None
    sources = list(io.sources)
    exited = proc.exited
    # From the exit on, input is refused and stdin closed, while the output still drains.
    exited.add_done_callback(lambda _: io.exited())
    try:
        while sources:
            moved = full = False
            for item in list(sources):  # a chunk from each in turn: neither starves
                channel, source = item
                chunk = source.read_now(DATA_CHUNK_BYTES - 1)
                if chunk is None:
                    continue
                moved = True
                if chunk:
                    full = full or len(chunk) == DATA_CHUNK_BYTES - 1
                    await stream.send_data(channel, chunk)
                else:
                    sources.remove(item)
                    await stream.send_eof(channel)
            if full:
                await asyncio.sleep(0)  # more may be there at once: let the loop run first
            elif not moved and not await _readable([source for _, source in sources], exited):
                break  # exited, and nothing came for DRAIN_IDLE_S
        if not exited.done():
            await asyncio.shield(exited)
    finally:
        if timer is not None:
            timer.cancel()
    return timed_out


async def _readable(sources: list[FdSource], exited: asyncio.Future[int]) -> bool:
    """Wait until one of ``sources`` may be read; False if the process has exited and
    none became readable within DRAIN_IDLE_S."""
    loop = asyncio.get_running_loop()
    wake: asyncio.Future[bool] = loop.create_future()
    idle: list[asyncio.TimerHandle] = []

    def ready(readable: bool) -> None:
        if not wake.done():
            wake.set_result(readable)

    def start_idle(_: object = None) -> None:
        idle.append(loop.call_later(DRAIN_IDLE_S, ready, False))

    if exited.done():
        start_idle()
    else:
        exited.add_done_callback(start_idle)
    for source in sources:
        loop.add_reader(source.fd, ready, True)
    try:
        return await wake
    finally:
        for source in sources:
            loop.remove_reader(source.fd)
        exited.remove_done_callback(start_idle)
        for handle in idle:
            handle.cancel()


async def _feed(stream: Stream, writer: asyncio.StreamWriter) -> None:
    """Copy INPUT to stdin, granting credit as it is written; close stdin at EOF."""
    broken = False
    while (data := await stream.read_input()) is not None:
        if not broken:
            try:
                writer.write(data)
                await writer.drain()
            except (BrokenPipeError, ConnectionResetError):
                broken = True  # the process stopped reading: discard the rest
        await stream.consumed(len(data) + 1)
    with contextlib.suppress(OSError):
        writer.close()


async def op_attach(stream: Stream, fields: Fields, table: ProcessTable) -> dict[str, object]:
    """Follow the background process ``process_id`` names, or the running one ``pid`` or
    ``tag`` names (the oldest, if several share the tag); exactly one of the three."""
    given = [key for key in ("process_id", "pid", "tag") if fields.mapping().get(key) is not None]
    if len(given) != 1:
        raise OpError(ErrorCode.INVALID_ARGUMENT, "give exactly one of process_id, pid and tag")
    if given == ["process_id"]:
        return await _follow(stream, table.get(fields.string("process_id", max_chars=64)))
    if given == ["pid"]:
        return await _follow(
            stream, table.running(pid=fields.integer("pid", 0, low=1, high=MAX_PID))
        )
    return await _follow(stream, table.running(tag=_tag(fields)))


async def _follow(stream: Stream, managed: ManagedProcess) -> dict[str, object]:
    """EVENT started, the buffered output, live output, both EOFs, then the process's
    end as RESULT. Cancelled (the host CANCELs, the session ends): the process runs on."""
    subscriber, replay = managed.subscribe()
    stream.on_signal = lambda signum: kill_group(managed.proc.pid, signum)
    try:
        pty = managed.spec.pty is not None
        await stream.send_event(_started(managed.process_id, managed.proc.pid, pty))
        for channel, data in replay:
            await stream.send_data(channel, data)
        while (item := await subscriber.get()) is not None:
            await stream.send_data(*item)
        await stream.send_eof(Channel.OUTPUT)
        await stream.send_eof(Channel.ERROR)
        return managed.result()
    finally:
        managed.unsubscribe(subscriber)


async def op_kill(fields: Fields, table: ProcessTable) -> dict[str, object]:
    signum = fields.integer("signal", 9, low=1, high=64)
    pid, running = table.pid_of(fields.string("process_id", max_chars=64))
    if running:
        kill_group(pid, signum)
    return {"ok": True}


async def op_list(stream: Stream, table: ProcessTable) -> dict[str, object]:
    items = [managed.info() for managed in table.all()]
    return {"ok": True, "processes": await send_batches(stream, "processes", items)}


async def op_input(stream: Stream, fields: Fields, table: ProcessTable) -> dict[str, object]:
    """Write the INPUT of this stream to a process's stdin (or terminal); ``eof`` closes it.

    At most MAX_INPUT_BYTES a call; concurrent calls for one process are written one
    after the other, whole. The RESULT counts the bytes written.
    """
    io = table.io_of(fields.string("process_id", max_chars=64))
    eof = fields.boolean("eof", False)
    io.check_input()
    written = 0
    async with io.lock:
        while (data := await stream.read_input()) is not None:
            written += len(data)
            if written > MAX_INPUT_BYTES:
                raise OpError(
                    ErrorCode.INVALID_ARGUMENT, f"more than {MAX_INPUT_BYTES} bytes of input"
                )
            await io.write(bytes(data))
            await stream.consumed(len(data) + 1)
        if eof:
            await io.close_input()
    return {"ok": True, "bytes": written}


async def op_resize(fields: Fields, table: ProcessTable) -> dict[str, object]:
    io = table.io_of(fields.string("process_id", max_chars=64))
    rows = fields.integer("rows", 0, low=1, high=MAX_PTY_SIZE)
    cols = fields.integer("cols", 0, low=1, high=MAX_PTY_SIZE)
    io.resize(rows, cols)
    return {"ok": True}
