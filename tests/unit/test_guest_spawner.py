"""spaced's spawner helpers: another account's processes vforked by a helper of that account.

The real spaced (--stdio, as root) runs processes as ``nobody``; what a helper started
is told by its parent's process name (``spaced-spawner``). Then spaced's end is fed
answers a hostile helper could send.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import deque
from pathlib import Path

import pytest

from space.guest import _spawn_helper, _spawner
from space.guest._errors import OpError
from space.guest._request import Account
from space.guest._spawner import _Helper
from space.node.api import ExecRequest, NotFound, PermissionDenied
from space.node.channel import GuestChannel

from ._guest_harness import Guest, run_with_channel
from .test_guest_daemon import collect

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running as another user needs root")

PARENT = ["sh", "-c", "cat /proc/$PPID/comm"]


def as_nobody(**fields: object) -> ExecRequest:
    return ExecRequest(user="nobody", **({"cwd": "/"} | fields))  # type: ignore[arg-type]


async def until_the_helper_spawns(channel: GuestChannel) -> None:
    """Exec as nobody until its parent is the helper (the first exec starts it)."""
    deadline = time.monotonic() + 20
    while True:
        out, _, exited = await collect(await channel.exec(as_nobody(argv=PARENT)))
        assert exited.exit_code == 0
        if out == b"spaced-spawner\n":
            return
        assert out == b"python3\n" or out.startswith(b"python"), out  # spaced itself
        assert time.monotonic() < deadline, "the helper never became ready"
        await asyncio.sleep(0.1)


@needs_root
def test_another_account_s_processes_run_through_its_helper_with_everything_an_exec_has(
    tmp_path: Path,
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        assert (await channel.system_info())["spawner_starting"] is False  # none yet
        await until_the_helper_spawns(channel)
        assert (await channel.system_info())["spawner_starting"] is False  # ready
        request = as_nobody(
            argv=["sh", "-c", 'id -un; echo "$GREETING" "$(pwd)"; cat; echo err >&2; exit 3'],
            env={"GREETING": "hello"},
            cwd="/tmp",
            stdin=b"from stdin\n",
        )
        out, err, exited = await collect(await channel.exec(request))
        assert out == b"nobody\nhello /tmp\nfrom stdin\n"
        assert (err, exited.exit_code, exited.signal) == (b"err\n", 3, None)

        # Input in pieces, then EOF (process.input), and a 1 MiB round trip.
        stream = await channel.exec(
            as_nobody(argv=["sh", "-c", PARENT[2] + "; cat"], open_stdin=True)
        )
        assert await channel.write_stdin(stream.process_id, b"one ") == 4
        assert await channel.write_stdin(stream.process_id, b"two", eof=True) == 3
        out, _, exited = await collect(stream)
        assert (out, exited.exit_code) == (b"spaced-spawner\none two", 0)
        data = os.urandom(1 << 20)
        out, _, exited = await collect(await channel.exec(as_nobody(argv=["cat"], stdin=data)))
        assert out == data and exited.exit_code == 0

        with pytest.raises(NotFound, match="no-such-program"):
            await channel.exec(as_nobody(argv=["no-such-program"]))
        with pytest.raises(NotFound, match="/no/such/dir"):
            await channel.exec(as_nobody(argv=["true"], cwd="/no/such/dir"))

        # A timeout kills the process's group.
        request = as_nobody(cmd="sleep 30 & sleep 30", timeout_s=0.5)
        _, _, exited = await collect(await channel.exec(request))
        assert exited.timed_out and exited.signal == signal.SIGKILL

        # A background process: listed, killed by its group (it runs in its own session).
        started = await channel.exec(as_nobody(cmd="sleep 30 & sleep 30", background=True))
        assert [event async for event in started] == []
        attached = await channel.attach(started.process_id)
        await channel.kill_process(started.process_id)
        _, _, exited = await collect(attached)
        assert exited.signal == signal.SIGKILL

        # A request too big for one datagram (non-ASCII goes as \u escapes: 40 KB on the
        # channel, 120 KB to the helper) spawns directly, as before.
        big = {"BIG": "é" * 20_000}
        out, _, exited = await collect(await channel.exec(as_nobody(argv=PARENT, env=big)))
        assert out.startswith(b"python") and exited.exit_code == 0

    run_with_channel(tmp_path, body)


#: Run as the helper's child: the descriptors the shell holds, and the signals it ignores.
_INHERITED = "ls /proc/$$/fd; grep SigIgn /proc/$$/status"
#: The signals Python ignores, which Popen restores for its children.
_PYTHON_IGNORES = (1 << (signal.SIGPIPE - 1)) | (1 << (signal.SIGXFSZ - 1))


@needs_root
def test_a_helper_s_child_holds_only_its_own_streams_ignores_no_signal_and_cds_as_the_account(
    tmp_path: Path,
) -> None:
    """The helper vforks by posix_spawn, which closes nothing and keeps ignored signals:
    nothing of the helper's (its socket, other requests' pipe ends) may reach a child,
    SIGPIPE and SIGXFSZ are restored as Popen does, and the cwd is entered as the
    account (a directory it may not enter is refused)."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)

    async def body(channel: GuestChannel, guest: Guest) -> None:
        await until_the_helper_spawns(channel)
        request = as_nobody(argv=["sh", "-c", _INHERITED], cwd="/tmp")
        out, err, exited = await collect(await channel.exec(request))
        *fds, ignored = out.decode().splitlines()
        assert (fds, err, exited.exit_code) == (["0", "1", "2"], b"", 0)
        assert int(ignored.split()[1], 16) & _PYTHON_IGNORES == 0, ignored
        with pytest.raises(PermissionDenied, match="private"):
            await channel.exec(as_nobody(argv=["true"], cwd=str(private)))
        out, _, exited = await collect(await channel.exec(as_nobody(argv=PARENT, cwd="/tmp")))
        assert (out, exited.exit_code) == (b"spaced-spawner\n", 0)  # the helper goes on

    run_with_channel(tmp_path, body)


@needs_root
def test_a_killed_helper_ends_its_processes_and_the_next_exec_still_runs(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        await until_the_helper_spawns(channel)
        started = await channel.exec(as_nobody(cmd="sleep 60", background=True))
        assert [event async for event in started] == []
        attached = await channel.attach(started.process_id)
        out, _, exited = await collect(
            await channel.exec(
                ExecRequest(argv=["pkill", "-x", "-e", "spaced-spawner"], user="root")
            )
        )
        assert exited.exit_code == 0 and b"killed" in out
        _, _, exited = await collect(attached)
        assert exited.signal == signal.SIGKILL  # its exit could no longer be known
        assert not alive(started.pid)
        # The helper died young: spaced spawns directly for a while (no new helper).
        for _ in range(3):
            out, _, exited = await collect(await channel.exec(as_nobody(argv=PARENT)))
            assert out.startswith(b"python") and exited.exit_code == 0
            await asyncio.sleep(0.3)

    run_with_channel(tmp_path, body)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (an orphan's zombie, killed, waits for whoever adopted it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class _Proc:
    pid = os.getpid()


def _helper() -> _Helper:
    helper = _Helper(Account("nobody", 65534, 65534, "/", ()))
    helper._proc = _Proc()  # type: ignore[assignment]
    return helper


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ([1, 2], "not an object"),
        ({"pid": 1}, "pid out of range"),
        ({"pid": True}, "pid out of range"),
        ({"exit": 123, "code": 999}, "exit out of range"),
        ({"exit": 123, "code": -65}, "exit out of range"),  # signals are 1 to 64
        ({"errno": "2", "error": "x", "filename": None}, "errno out of range"),
        ({"errno": 2, "error": "x" * 600, "filename": None}, "errno out of range"),
        ({"errno": 2, "error": "x", "filename": 5}, "filename not a string"),
        ({"something": "else"}, "unknown answer"),
    ],
)
def test_spaced_refuses_what_a_helper_should_not_say(answer: object, why: str) -> None:
    async def main() -> None:
        helper = _helper()
        request: asyncio.Future[tuple[int, asyncio.Future[int]]]
        request = asyncio.get_running_loop().create_future()
        helper._answers.append(request)
        with pytest.raises(ValueError, match=why):
            helper._on_answer(answer)
        assert not request.done()

    asyncio.run(main())


def test_an_answer_to_no_request_is_refused_and_an_ended_helper_fails_its_requests() -> None:
    async def main() -> None:
        helper = _helper()
        with pytest.raises(ValueError, match="an answer to no request"):
            helper._on_answer({"errno": 2, "error": "x", "filename": None})
        waiting: asyncio.Future[tuple[int, asyncio.Future[int]]]
        waiting = asyncio.get_running_loop().create_future()
        helper._answers.append(waiting)
        helper._proc = None
        helper._end("a test")
        assert helper.ended and not helper.ready
        with pytest.raises(Exception, match="a test"):
            waiting.result()
        assert not isinstance(waiting.exception(), OpError)

    asyncio.run(main())


@pytest.mark.parametrize("gone", [FileNotFoundError, ProcessLookupError])
def test_a_child_gone_before_its_pid_is_checked_is_taken(
    gone: type[OSError], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``true`` can end, and be reaped, before spaced reads its /proc entry: the open
    fails (ENOENT) or the read does (ESRCH); the helper's exit answer follows."""

    def vanished(*args: object, **kwargs: object) -> None:
        raise gone()

    monkeypatch.setattr(_spawner, "open", vanished, raising=False)

    async def main() -> None:
        helper = _helper()
        request: asyncio.Future[tuple[int, asyncio.Future[int]]]
        request = asyncio.get_running_loop().create_future()
        helper._answers.append(request)
        helper._on_answer({"pid": 4242})
        pid, exited = request.result()
        helper._on_answer({"exit": 4242, "code": 0})
        assert (pid, exited.result()) == (4242, 0)

    asyncio.run(main())


def test_a_helper_that_died_young_is_replaced_a_minute_later_an_old_one_at_once() -> None:
    async def main() -> None:
        young, old = _helper(), _helper()
        young._proc = old._proc = None
        old.started_at -= 3600
        young._end("a test")
        old._end("a test")
        now = time.monotonic()
        assert now + 50 < young.retry_at <= now + 60
        assert old.retry_at <= now

    asyncio.run(main())


def test_the_answer_to_a_cancelled_exec_is_its_own_and_its_process_is_ended() -> None:
    """Answers come in order: a cancelled exec's pid must not go to the next exec (it
    would get another's process); that process is ended, as a cancelled exec's is."""
    orphan = subprocess.Popen(["sleep", "30"], start_new_session=True)
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)

    async def main() -> None:
        helper = _helper()
        helper.account = Account("me", os.getuid(), os.getgid(), "/", ())
        cancelled: asyncio.Future[tuple[int, asyncio.Future[int]]]
        waiting: asyncio.Future[tuple[int, asyncio.Future[int]]]
        cancelled = asyncio.get_running_loop().create_future()
        waiting = asyncio.get_running_loop().create_future()
        helper._answers.extend([cancelled, waiting])
        cancelled.cancel()
        helper._on_answer({"pid": orphan.pid})
        assert not waiting.done()
        helper._on_answer({"pid": other.pid})
        assert waiting.result()[0] == other.pid

    try:
        asyncio.run(main())
        assert orphan.wait(timeout=10) == -signal.SIGKILL
    finally:
        for process in (orphan, other):
            process.kill()
            process.wait()


def test_a_pid_that_leads_no_session_of_its_own_is_refused() -> None:
    """spaced signals a process's group as root: a helper naming spaced itself, or a
    process inside another's session (as spaced and init are), is refused."""
    inside = subprocess.Popen(["sleep", "30"])  # in this test's session
    leader = subprocess.Popen(["sleep", "30"], start_new_session=True)

    async def main() -> None:
        for pid in (inside.pid, os.getpid()):
            helper = _helper()
            helper._answers.append(asyncio.get_running_loop().create_future())
            with pytest.raises(ValueError, match="does not lead a session of its own"):
                helper._on_answer({"pid": pid})
        helper = _helper()
        helper._answers.append(asyncio.get_running_loop().create_future())
        helper._on_answer({"pid": leader.pid})
        assert helper._answers == deque() and leader.pid in helper._exits

    try:
        asyncio.run(main())
    finally:
        for process in (inside, leader):
            process.kill()
            process.wait()


def test_a_helper_finds_a_program_by_stats_where_execvp_would_and_leaves_the_rest_to_it(
    tmp_path: Path,
) -> None:
    first, second, third = (tmp_path / name for name in ("first", "second", "third"))
    for directory in (first, second, third):
        directory.mkdir()
    (first / "tool").write_text("#!/bin/sh\n")  # not executable: execvp goes on
    (first / "dir-tool").mkdir()  # a directory: so does execvp
    (second / "tool").write_text("#!/bin/sh\n")
    (second / "tool").chmod(0o755)
    (third / "dir-tool").write_text("#!/bin/sh\n")
    (third / "dir-tool").chmod(0o755)
    path = {"PATH": f"{first}:{second}:{third}"}
    assert _spawn_helper._program_path(["tool", "-x"], path) == str(second / "tool")
    assert _spawn_helper._program_path(["dir-tool"], path) == str(third / "dir-tool")
    # Left to execvp: not found (its error is the answer), a path, a relative
    # directory (the child's cwd's, not the helper's), no argv.
    assert _spawn_helper._program_path(["missing"], path) is None
    assert _spawn_helper._program_path(["./tool"], path) is None
    assert _spawn_helper._program_path(["tool"], {"PATH": f"bin:{second}"}) is None
    assert _spawn_helper._program_path([], path) is None
    assert _spawn_helper._program_path(["sh"], {}) in ("/bin/sh", "/usr/bin/sh")  # os.defpath


@pytest.mark.parametrize("posix_spawn", [True, False], ids=["posix_spawn", "popen"])
def test_both_ways_of_a_helper_start_a_program_alike(
    tmp_path: Path, posix_spawn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """posix_spawn (in a VM) and Popen (under gVisor, ``--popen``): the request's argv,
    env and cwd, its pipes as the streams, its own session, Python's ignored signals
    restored; and a program not found on PATH is Popen's error either way."""
    monkeypatch.chdir(tmp_path)  # the helper enters the cwd itself: ours comes back after
    children: dict[int, subprocess.Popen[bytes] | None] = {}
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    script = (
        'echo "$0 $GREETING $(pwd)"; echo err >&2;'
        ' grep SigIgn /proc/$$/status; cut -d" " -f6 /proc/$$/stat'
    )
    request: dict[str, object] = {
        "argv": ["sh", "-c", script],
        "env": {"PATH": "/usr/bin:/bin", "GREETING": "hello"},
        "cwd": str(tmp_path),
        "stdin": False,
    }
    try:
        pid = _spawn_helper._spawn(request, [out_write, err_write], children, posix_spawn)
    finally:
        os.close(out_write)
        os.close(err_write)
    with os.fdopen(out_read, "rb") as out, os.fdopen(err_read, "rb") as err:
        lines, error = out.read().decode().splitlines(), err.read()
    _, status = os.waitpid(pid, 0)
    child = children.pop(pid)
    assert (child is None) == posix_spawn
    if child is not None:
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped here, as the helper does
    assert (lines[0], error, os.waitstatus_to_exitcode(status)) == (
        f"sh hello {tmp_path}",
        b"err\n",
        0,
    )
    assert int(lines[1].split()[1], 16) & _PYTHON_IGNORES == 0, lines[1]
    assert int(lines[2]) == pid  # a session of its own
    missing = request | {"argv": ["no-such-program"]}
    with pytest.raises(FileNotFoundError, match="no-such-program"):
        _spawn_helper._spawn(missing, [1, 2], children, posix_spawn)
