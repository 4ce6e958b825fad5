"""Spawning processes and the table of background processes.

Every process runs in its own session (start_new_session), so a timeout or a kill
reaches its whole process group. A background process keeps the last ``RING_BYTES`` of
stdout and of stderr (of its terminal, with a PTY); attached streams get the replay,
then live output (they apply backpressure: a slow attached host slows the process, it
never grows guest memory). Processes started with ``open_stdin`` or ``pty`` take input
later, by process id (``ProcessTable.io_of``, docs/protocol.md "process.input").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from space.protocol import DATA_CHUNK_BYTES, Channel, ErrorCode

from ._errors import OpError
from ._request import Account
from ._spawner import Spawners
from ._stdio import FdSource, ProcessIo, open_pty, take_terminal

__all__ = [
    "DirectProcess",
    "ExecSpec",
    "ManagedProcess",
    "ProcessTable",
    "Spawned",
    "Subscriber",
    "kill_group",
    "spawn",
]

RING_BYTES = 1024 * 1024
MAX_PROCESSES = 256
#: How long output may still arrive after the process exited (a grandchild can hold the
#: pipes open forever; we stop waiting for it after this much silence).
DRAIN_IDLE_S = 0.5
_SUBSCRIBER_ITEMS = 8


@dataclass(frozen=True, slots=True)
class ExecSpec:
    argv: list[str]
    cmd: str | None
    env: dict[str, str]
    cwd: str
    account: Account
    stdin: bool
    timeout_s: float | None
    background: bool
    #: Keep stdin a pipe for process.input until it is closed (issue 20).
    open_stdin: bool = False
    #: (rows, cols) of a pseudo-terminal the process runs on; None: pipes.
    pty: tuple[int, int] | None = None
    tag: str | None = None


def default_env(account: Account) -> dict[str, str]:
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": account.home,
        "USER": account.name,
        "LOGNAME": account.name,
        "LANG": "C.UTF-8",
    }


class Spawned(Protocol):
    """A started process as spaced uses it: one asyncio started (DirectProcess), or one
    a spawner helper started; its output's pipes are read directly (FdSource)."""

    @property
    def pid(self) -> int: ...

    @property
    def stdin(self) -> asyncio.StreamWriter | None: ...

    @property
    def stdout(self) -> FdSource: ...

    @property
    def stderr(self) -> FdSource: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def exited(self) -> asyncio.Future[int]:
        """Done with the returncode once the process has ended (never cancel it)."""
        ...

    async def wait(self) -> int: ...


class DirectProcess:
    """A process asyncio started (root's own, a PTY's, or no spawner helper ready):
    asyncio watches for its exit; its output comes through descriptors of ours (pipes,
    or the PTY's master side), not asyncio's transports."""

    def __init__(self, proc: asyncio.subprocess.Process, stdout: FdSource, stderr: FdSource):
        self._proc = proc
        self.pid = proc.pid
        self.stdin = proc.stdin
        self.stdout = stdout
        self.stderr = stderr
        self.exited: asyncio.Future[int] = asyncio.ensure_future(proc.wait())

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)


async def spawn(spec: ExecSpec, spawners: Spawners) -> tuple[Spawned, ProcessIo]:
    """Start the process (a shell only when ``cmd`` was given): through the account's
    spawner helper when it has one ready, else directly."""
    if spec.pty is not None:
        return await _spawn_pty(spec, *spec.pty)
    piped = spec.open_stdin or (spec.stdin and not spec.background)
    proc: Spawned | None = await spawners.spawn(
        spec.account, spec.argv, spec.env, spec.cwd, piped=piped
    )
    if proc is None:
        proc = await _spawn_direct(spec, piped)
    sources = [(Channel.OUTPUT, proc.stdout), (Channel.ERROR, proc.stderr)]
    return proc, ProcessIo(sources, stdin=proc.stdin if spec.open_stdin else None)


async def _spawn_direct(spec: ExecSpec, piped: bool) -> DirectProcess:
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            *spec.argv,
            stdin=subprocess.PIPE if piped else subprocess.DEVNULL,
            stdout=out_write,
            stderr=err_write,
            cwd=spec.cwd,
            env=spec.env,
            start_new_session=True,
            **spec.account.spawn_kwargs(),  # type: ignore[arg-type]
        )
    except BaseException:
        os.close(out_read)
        os.close(err_read)
        raise
    finally:
        os.close(out_write)
        os.close(err_write)
    return DirectProcess(proc, FdSource(out_read), FdSource(err_read))


async def _spawn_pty(spec: ExecSpec, rows: int, cols: int) -> tuple[Spawned, ProcessIo]:
    master, slave = open_pty(rows, cols)
    try:
        proc = await asyncio.create_subprocess_exec(
            *spec.argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=spec.cwd,
            env={"TERM": "xterm-256color"} | spec.env,
            start_new_session=True,
            preexec_fn=take_terminal,
            **spec.account.spawn_kwargs(),  # type: ignore[arg-type]
        )
    except BaseException:
        master.close()
        raise
    finally:
        os.close(slave)  # the child holds it now; its EOF (EIO) is the child's exit
    return DirectProcess(proc, master, master), ProcessIo([(Channel.OUTPUT, master)], pty=master)


def kill_group(pid: int, signum: int = signal.SIGKILL) -> None:
    """Signal the process group led by ``pid``; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def exit_fields(returncode: int | None) -> tuple[int | None, int | None]:
    """(exit_code, signal) from a returncode (negative means killed by a signal)."""
    if returncode is None:
        return None, None
    if returncode < 0:
        return None, -returncode
    return returncode, None


def new_process_id() -> str:
    return "p" + secrets.token_hex(8)


async def wait_exit(proc: Spawned, timeout_s: float | None) -> bool:
    """Wait for the process; on timeout kill its group. Returns whether it timed out."""
    try:
        async with asyncio.timeout(timeout_s):
            await proc.wait()
            return False
    except TimeoutError:
        kill_group(proc.pid)
        await proc.wait()
        return True


class Subscriber:
    """A bounded queue of output items for one attached stream."""

    def __init__(self) -> None:
        self.items: deque[tuple[Channel, bytes] | None] = deque()
        self.closed = False
        self._changed = asyncio.Event()

    async def put(self, item: tuple[Channel, bytes] | None) -> None:
        while len(self.items) >= _SUBSCRIBER_ITEMS and not self.closed:
            self._changed.clear()
            await self._changed.wait()
        if not self.closed:
            self.items.append(item)
            self._changed.set()

    async def get(self) -> tuple[Channel, bytes] | None:
        """Next (channel, chunk), or None once the process has exited."""
        while not self.items:
            self._changed.clear()
            await self._changed.wait()
        item = self.items.popleft()
        self._changed.set()
        return item

    def close(self) -> None:
        self.closed = True
        self._changed.set()


@dataclass
class ManagedProcess:
    process_id: str
    spec: ExecSpec
    proc: Spawned
    io: ProcessIo
    started_at: float = field(default_factory=time.time)
    timed_out: bool = False
    rings: dict[Channel, bytearray] = field(
        default_factory=lambda: {Channel.OUTPUT: bytearray(), Channel.ERROR: bytearray()}
    )
    subscribers: list[Subscriber] = field(default_factory=list)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    monitor: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    def info(self) -> dict[str, object]:
        exit_code, signum = exit_fields(self.proc.returncode)
        return {
            "process_id": self.process_id,
            "pid": self.proc.pid,
            "argv": None if self.spec.cmd is not None else self.spec.argv,
            "cmd": self.spec.cmd,
            "running": self.running,
            "exit_code": exit_code,
            "signal": signum,
            "started_at": self.started_at,
            "tag": self.spec.tag,
            "pty": self.spec.pty is not None,
        }

    def result(self) -> dict[str, object]:
        exit_code, signum = exit_fields(self.proc.returncode)
        return {"ok": True, "exit_code": exit_code, "signal": signum, "timed_out": self.timed_out}

    def subscribe(self) -> tuple[Subscriber, list[tuple[Channel, bytes]]]:
        """A live subscriber plus the replay, taken atomically (no await in between)."""
        replay = [(channel, bytes(ring)) for channel, ring in self.rings.items() if ring]
        subscriber = Subscriber()
        if self.finished.is_set():
            subscriber.items.append(None)
        else:
            self.subscribers.append(subscriber)
        return subscriber, replay

    def unsubscribe(self, subscriber: Subscriber) -> None:
        subscriber.close()
        with contextlib.suppress(ValueError):
            self.subscribers.remove(subscriber)

    def start(self) -> None:
        self.monitor = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        pumps = [
            asyncio.create_task(self._pump(source, channel)) for channel, source in self.io.sources
        ]
        self.timed_out = await wait_exit(self.proc, self.spec.timeout_s)
        self.io.exited()
        await asyncio.wait(pumps, timeout=DRAIN_IDLE_S * 2)
        self.finished.set()
        for subscriber in list(self.subscribers):
            await subscriber.put(None)
        self.subscribers.clear()
        try:
            # Pumps still running belong to grandchildren holding the pipes (or the
            # terminal): keep the ring fed.
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self.io.release()

    async def _pump(self, reader: FdSource, channel: Channel) -> None:
        ring = self.rings[channel]
        while chunk := await reader.read(DATA_CHUNK_BYTES - 1):
            ring += chunk
            if len(ring) > RING_BYTES:
                del ring[: len(ring) - RING_BYTES]
            for subscriber in list(self.subscribers):
                await subscriber.put((channel, chunk))


class ProcessTable:
    """Background processes by id; outlives sessions; bounded to MAX_PROCESSES."""

    def __init__(self, limit: int = MAX_PROCESSES, *, spawners: Spawners) -> None:
        self._limit = limit
        self._processes: dict[str, ManagedProcess] = {}
        #: Foreground processes by id, so process.kill reaches them too (not listed).
        self.foreground: dict[str, Spawned] = {}
        #: Their standard streams, so process.input and process.resize reach them too.
        self.foreground_io: dict[str, ProcessIo] = {}
        #: The helpers that start processes as other accounts than spaced's.
        self.spawners = spawners

    def add(self, managed: ManagedProcess) -> None:
        if len(self._processes) >= self._limit:
            self._evict()
        self._processes[managed.process_id] = managed
        managed.start()

    def reserve(self) -> None:
        """Raise resource_exhausted if no slot can be made (all entries still running)."""
        if len(self._processes) >= self._limit and all(p.running for p in self._processes.values()):
            raise OpError(ErrorCode.RESOURCE_EXHAUSTED, f"{self._limit} background processes")

    def _evict(self) -> None:
        for process_id, managed in self._processes.items():  # oldest first (insertion)
            if managed.finished.is_set() or not managed.running:
                del self._processes[process_id]
                return
        raise OpError(ErrorCode.RESOURCE_EXHAUSTED, f"{self._limit} background processes")

    def pid_of(self, process_id: str) -> tuple[int, bool]:
        """(pid, running) of a background or foreground process; raises not_found."""
        proc = self.foreground.get(process_id)
        if proc is None:
            proc = self.get(process_id).proc
        return proc.pid, proc.returncode is None

    def io_of(self, process_id: str) -> ProcessIo:
        """The standard streams of a background or foreground process; raises not_found."""
        io = self.foreground_io.get(process_id)
        return io if io is not None else self.get(process_id).io

    def get(self, process_id: str) -> ManagedProcess:
        managed = self._processes.get(process_id)
        if managed is None:
            raise OpError(ErrorCode.NOT_FOUND, f"no process {process_id!r}")
        return managed

    def running(self, *, pid: int | None = None, tag: str | None = None) -> ManagedProcess:
        """The oldest running background process with ``pid`` (or else ``tag``); raises
        not_found (an ended one is not found, as E2B's envd finds none: issue 20)."""
        for managed in self._processes.values():  # insertion order: oldest first
            if managed.running and (
                managed.proc.pid == pid if tag is None else managed.spec.tag == tag
            ):
                return managed
        what = f"pid {pid}" if tag is None else f"tag {tag!r}"
        raise OpError(ErrorCode.NOT_FOUND, f"no running process with {what}")

    def all(self) -> list[ManagedProcess]:
        return list(self._processes.values())

    def kill_all(self) -> None:
        for managed in self._processes.values():
            if managed.running:
                kill_group(managed.proc.pid)
