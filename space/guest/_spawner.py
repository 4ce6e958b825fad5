"""Spawners: a helper per account that starts that account's processes for spaced.

Why: CPython forks (it cannot vfork) a child that changes its uid, and a fork copies
spaced's whole address space: under gVisor's ptrace platform that was 38.8 ms for
``true`` against 11.6 ms vforked, and a fork is as dear under TCG. A helper that already
runs as the account vforks instead (space.guest._spawn_helper: its protocol). spaced
starts it the first time it runs a process as that account, and spawns directly until
the helper says it is ready.

spaced makes the pipes and passes the child's ends over a socketpair (SOCK_SEQPACKET,
SCM_RIGHTS) with argv, env and cwd. The helper runs as the tenant's own account, so
spaced believes nothing it says unchecked: answers are bounded, a pid must lead a
session of its own (while it lives), an exit must name a pid it spawned. If the
helper ends, its processes still running are killed (their exits could no longer be
known) and a later spawn starts another helper. A PTY (its child takes the terminal in
a preexec_fn), root's own processes and requests over ``MAX_REQUEST_BYTES`` spawn
directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from typing import TYPE_CHECKING

from space.protocol import ErrorCode

from . import PACKAGE_ROOT
from ._errors import OpError
from ._spawn_helper import MAX_REQUEST_BYTES, POPEN_ONLY
from ._stdio import FdSource

if TYPE_CHECKING:
    from ._request import Account

__all__ = ["HelperProcess", "Spawners"]

_log = logging.getLogger("spaced.spawner")

#: The largest answer an honest helper sends (an errno with its text and a path).
_MAX_ANSWER_BYTES = 64 * 1024
#: At most this many accounts get a helper; others spawn directly.
_MAX_HELPERS = 8
#: A helper that ended sooner than this after it started is not started again before
#: ``_RETRY_AFTER_S`` (a broken one must not cost a start on every exec).
_QUICK_DEATH_S = 10.0
_RETRY_AFTER_S = 60.0
#: A helper not ready this long after its start is ended (a python starts in well under
#: a second under gVisor, a few seconds under TCG).
_READY_TIMEOUT_S = 60.0


class _HelperGone(Exception):
    """The helper ended (or lied) before it answered a request."""


class HelperProcess:
    """A process a helper started, shaped as space.guest._processes.Spawned: ``pid``,
    ``returncode``, ``exited``, ``wait()`` and the parent's ends of its pipes."""

    def __init__(
        self,
        pid: int,
        exited: asyncio.Future[int],
        stdin: asyncio.StreamWriter | None,
        stdout: FdSource,
        stderr: FdSource,
    ) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self._exited = exited

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    @property
    def exited(self) -> asyncio.Future[int]:
        return self._exited

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


class _Helper:
    """spaced's end of one account's helper."""

    def __init__(self, account: Account, posix_spawn: bool = True) -> None:
        self.account = account
        self.posix_spawn = posix_spawn
        self.ready = False
        self.ended = False
        self.started_at = time.monotonic()
        #: When an ended helper may be replaced (a minute later after a quick death).
        self.retry_at = 0.0
        self._sock: socket.socket | None = None
        self._proc: asyncio.subprocess.Process | None = None
        #: Requests sent and not answered yet, oldest first (the helper answers in order).
        self._answers: deque[asyncio.Future[tuple[int, asyncio.Future[int]]]] = deque()
        #: Exits to come, by pid, of the processes the helper started.
        self._exits: dict[int, asyncio.Future[int]] = {}

    async def start(self) -> None:
        """Start the helper; it is ``ready`` once it says so (or ``ended`` on failure)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        account = self.account
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-B",
                "-m",
                "space.guest._spawn_helper",
                str(theirs.fileno()),
                *([] if self.posix_spawn else [POPEN_ONLY]),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                cwd="/",
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": PACKAGE_ROOT},
                start_new_session=True,
                user=account.uid,
                group=account.gid,
                extra_groups=list(account.groups),
            )
        except (OSError, ValueError) as exc:
            ours.close()
            self._end(f"cannot start it: {exc}")
            return
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        if self.ended:  # closed while it started
            self.ended = False
            self._end("closed")
            return
        loop = asyncio.get_running_loop()
        loop.add_reader(ours.fileno(), self._on_readable)
        loop.call_later(_READY_TIMEOUT_S, self._check_ready)

    def _check_ready(self) -> None:
        if not (self.ready or self.ended):
            self._end(f"not ready after {_READY_TIMEOUT_S:.0f} s")

    def spawn_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self.start())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def spawn(
        self, argv: list[str], env: dict[str, str], cwd: str, piped: bool
    ) -> HelperProcess | None:
        """Start a process through the helper; None if the request is too big to send
        (spawn it directly). Raises OSError as subprocess would (no such program,
        no such cwd), or OpError if the helper ended without answering."""
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "stdin": piped}).encode()
        if len(request) > MAX_REQUEST_BYTES or self._sock is None:
            return None
        ends: list[int] = []  # ours: stdin's write end (if piped), stdout's and stderr's read ends
        theirs: list[int] = []
        started = False
        try:
            if piped:
                read_end, write_end = os.pipe()
                ends.append(write_end)
                theirs.append(read_end)
            for _ in range(2):
                read_end, write_end = os.pipe()
                ends.append(read_end)
                theirs.append(write_end)
            try:
                socket.send_fds(self._sock, [request], theirs)
            except BlockingIOError:  # the helper is behind: spawn this one directly
                return None
            except OSError as exc:
                self._end(f"send failed: {exc}")
                return None
            answer: asyncio.Future[tuple[int, asyncio.Future[int]]]
            answer = asyncio.get_running_loop().create_future()
            self._answers.append(answer)
            for fd in theirs:
                os.close(fd)
            theirs.clear()
            try:
                pid, exited = await answer
            except _HelperGone as exc:
                raise OpError(
                    ErrorCode.INTERNAL,
                    f"the spawner of {self.account.name} ended before it answered ({exc}):"
                    " the process may have started",
                ) from None
            started = True
        finally:
            for fd in theirs if started else theirs + ends:
                os.close(fd)
        return await _process(pid, exited, ends, piped)

    async def close(self) -> None:
        """End the helper (and what it started) and wait for it, briefly."""
        self._end("closed")
        if self._proc is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    await self._proc.wait()

    # -- the helper's answers --

    def _on_readable(self) -> None:
        assert self._sock is not None
        while not self.ended:
            try:
                data, _, flags, _ = self._sock.recvmsg(_MAX_ANSWER_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._end(f"read failed: {exc}")
                return
            if not data:
                self._end("it exited")
                return
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                self._end("an answer too long, or with descriptors")
                return
            try:
                self._on_answer(json.loads(data))
            except Exception as exc:  # whatever it is, a request must not wait forever
                self._end(f"a bad answer: {exc!r}")
                return

    def _on_answer(self, answer: object) -> None:
        if not isinstance(answer, dict):
            raise ValueError("not an object")
        if answer.keys() == {"ready"}:
            self.ready = True
        elif answer.keys() == {"exit", "code"}:
            pid, code = answer["exit"], answer["code"]
            if not (_is_int(pid) and _is_int(code) and -64 <= code < 256):
                raise ValueError("exit out of range")
            future = self._exits.pop(pid, None)
            if future is not None and not future.done():
                future.set_result(code)
        elif answer.keys() == {"pid"}:
            pid = answer["pid"]
            if not (_is_int(pid) and pid > 1) or pid in self._exits:
                raise ValueError("pid out of range")
            self._check_child(pid)
            exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self._exits[pid] = exited
            request = self._next_answer()
            if request.done():  # its exec was cancelled (the host went): end the process
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            else:
                request.set_result((pid, exited))
        elif answer.keys() == {"errno", "error", "filename"}:
            number, text, filename = answer["errno"], answer["error"], answer["filename"]
            if not (_is_int(number) and isinstance(text, str) and len(text) <= 512):
                raise ValueError("errno out of range")
            if filename is not None and not isinstance(filename, str):
                raise ValueError("filename not a string")
            exc = OSError(number, text) if filename is None else OSError(number, text, filename)
            request = self._next_answer()
            if not request.done():
                request.set_exception(exc)
        else:
            raise ValueError(f"unknown answer {sorted(answer)}")

    def _next_answer(self) -> asyncio.Future[tuple[int, asyncio.Future[int]]]:
        """The oldest request's future: cancelled (done) if its exec was, and still
        answered, or the next request would take its answer."""
        if not self._answers:
            raise ValueError("an answer to no request")
        return self._answers.popleft()

    def _check_child(self, pid: int) -> None:
        """Refuse a pid whose group spaced must not signal (it signals groups as root):
        the helper's children each lead a session of their own (start_new_session);
        spaced, init and their groups do not. One getsid: reading /proc/PID/status
        took 0.9 ms under gVisor, per exec. A child gone already cannot be checked, and
        cannot be signalled either."""
        try:
            session = os.getsid(pid)
        except ProcessLookupError:
            return
        if session != pid or pid == os.getpid():
            raise ValueError(f"pid {pid} does not lead a session of its own")

    def _end(self, why: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.ready = False
        now = time.monotonic()
        self.retry_at = now + _RETRY_AFTER_S if now < self.started_at + _QUICK_DEATH_S else now
        level = logging.INFO if why == "closed" else logging.WARNING
        _log.log(level, "the spawner of %s ended: %s", self.account.name, why)
        if self._sock is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
        while self._answers:
            answer = self._answers.popleft()
            if not answer.done():
                answer.set_exception(_HelperGone(why))
        for pid, exited in self._exits.items():
            # Their exits would never be known: end them now, and say so.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            if not exited.done():
                exited.set_result(-signal.SIGKILL)
        self._exits.clear()
        if self._proc is not None:
            if self._proc.returncode is None:  # not Process.kill: its poll() would reap
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._proc.pid, signal.SIGKILL)
            task = asyncio.get_running_loop().create_task(self._proc.wait())
            _background.add(task)
            task.add_done_callback(_background.discard)


class Spawners:
    """The helpers of the accounts spaced runs processes as (not its own).

    ``posix_spawn``: whether the helpers start programs with it (space.guest.
    _spawn_helper: cheaper than Popen in a VM, dearer under gVisor)."""

    def __init__(self, *, posix_spawn: bool = True) -> None:
        self._helpers: dict[tuple[int, int, tuple[int, ...]], _Helper] = {}
        self._posix_spawn = posix_spawn

    async def spawn(
        self, account: Account, argv: list[str], env: dict[str, str], cwd: str, *, piped: bool
    ) -> HelperProcess | None:
        """Start a process as ``account`` through its helper, if it has one ready;
        None: spawn it directly (root's own, no helper yet, a helper ended lately)."""
        if account.uid == os.geteuid():
            return None  # no uid change: CPython vforks already
        key = (account.uid, account.gid, account.groups)
        helper = self._helpers.get(key)
        if helper is None or (helper.ended and helper.retry_at <= time.monotonic()):
            if helper is None and len(self._helpers) >= _MAX_HELPERS:
                return None
            helper = self._helpers[key] = _Helper(account, self._posix_spawn)
            helper.spawn_soon()
        if not helper.ready:
            return None
        return await helper.spawn(argv, env, cwd, piped)

    @property
    def starting(self) -> bool:
        """Whether a helper is starting (not ready yet, not ended)."""
        return any(not (helper.ready or helper.ended) for helper in self._helpers.values())

    async def close(self) -> None:
        helpers = list(self._helpers.values())
        self._helpers.clear()
        await asyncio.gather(*(helper.close() for helper in helpers))


_background: set[asyncio.Task[object]] = set()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def _process(
    pid: int, exited: asyncio.Future[int], ends: list[int], piped: bool
) -> HelperProcess:
    """Our pipe ends: stdin's in the loop's stream (as asyncio.subprocess does), the
    output's read directly (FdSource: no transport to set up per exec)."""
    writer = None
    if piped:
        loop = asyncio.get_running_loop()
        pipe = os.fdopen(ends[0], "wb", buffering=0)
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, pipe)
        writer = asyncio.StreamWriter(transport, protocol, None, loop)
    return HelperProcess(pid, exited, writer, FdSource(ends[-2]), FdSource(ends[-1]))
