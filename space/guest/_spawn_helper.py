"""The spawner helper: runs as one account and starts its processes for spaced.

``python3 -m space.guest._spawn_helper FD [--popen]`` (space.guest._spawner starts it
and says why; ``--popen`` under gVisor, see ``_spawn``). It imports as little as it
can: it lives as long as the sandbox, one per account.
Requests come from spaced (root) over the socket FD, one datagram each: JSON
``{"argv", "env", "cwd", "stdin"}`` with the child's pipe ends (stdin's only when
``stdin``, then stdout's and stderr's). Answers, in order: ``{"ready": true}`` once,
then per request ``{"pid"}`` or ``{"errno", "error", "filename"}``, and ``{"exit",
"code"}`` when a child ends (always after its pid's answer).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys

__all__ = ["MAX_REQUEST_BYTES", "NAME", "POPEN_ONLY", "serve"]

#: A request bigger than this (a huge environment) spaced spawns itself: a datagram of
#: the socketpair must fit the socket's buffer.
MAX_REQUEST_BYTES = 64 * 1024
#: The helper's process name (``comm``): ``pkill python3`` or ``killall python3`` in a
#: sandbox pass it by.
NAME = b"spaced-spawner"
#: The helper's argument that makes it start every program with Popen (under gVisor).
POPEN_ONLY = "--popen"
_PR_SET_NAME = 15
#: What Popen's restore_signals resets in a child: Python ignores them, an exec keeps that.
_RESTORED_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)
#: A child of ours: Popen's (which must learn the exit we reap) or posix_spawn's (None).
_Child = subprocess.Popen[bytes] | None


def serve(sock: socket.socket, *, posix_spawn: bool = True) -> None:
    """Answer spaced's requests until it closes the socket; report every child's exit.
    ``posix_spawn``: start programs found on PATH with it (else all with Popen)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, NAME, 0, 0, 0)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    # posix_spawn closes no descriptor: the socket (passed to us inheritable) must not
    # reach the children, nor must the pipe ends spaced sends (set so below).
    os.set_inheritable(sock.fileno(), False)
    children: dict[int, _Child] = {}
    _answer(sock, {"ready": True})
    while True:
        readable, _, _ = select.select([sock.fileno(), wake_read], [], [])
        if wake_read in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_read, 512):
                    pass
            _reap(sock, children)
        if sock.fileno() in readable:
            data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST_BYTES, 3)
            for fd in fds:  # (recv_fds drops a MSG_CMSG_CLOEXEC flag)
                os.set_inheritable(fd, False)
            if not data:
                return  # spaced closed its end: the children live on
            try:
                _start(sock, json.loads(data), fds, children, posix_spawn)
            finally:
                for fd in fds:
                    os.close(fd)


def _start(
    sock: socket.socket,
    request: dict[str, object],
    fds: list[int],
    children: dict[int, _Child],
    posix_spawn: bool,
) -> None:
    try:
        pid = _spawn(request, fds, children, posix_spawn)
    except OSError as exc:
        filename = exc.filename if isinstance(exc.filename, str) else None
        text = (exc.strerror or str(exc))[:512]
        _answer(sock, {"errno": exc.errno or errno.EINVAL, "error": text, "filename": filename})
    except (ValueError, TypeError, subprocess.SubprocessError) as exc:
        _answer(sock, {"errno": errno.EINVAL, "error": str(exc)[:512], "filename": None})
    else:
        _answer(sock, {"pid": pid})


def _spawn(
    request: dict[str, object], fds: list[int], children: dict[int, _Child], posix_spawn: bool
) -> int:
    """Start the request's process in a session of its own; its pid.

    With its program found on PATH and ``posix_spawn``, by posix_spawn: a vfork without
    Popen's Python around it (``true`` spawned and reaped under TCG: 3.7 ms, against 4.9
    by Popen; issue 21), in the request's cwd (we are single-threaded: a chdir of ours
    is the child's, entered as the account). Else by Popen, whose execvpe semantics (a
    path given, a relative PATH directory, a program not found) it is simplest to keep.
    Either vforks: no uid change, no preexec_fn.
    """
    argv, env, cwd = request["argv"], request["env"], request["cwd"]
    stdin: int = fds[0] if request["stdin"] else subprocess.DEVNULL
    path = _program_path(argv, env)  # type: ignore[arg-type]
    if path is None or not posix_spawn:
        child = subprocess.Popen(
            argv,  # type: ignore[call-overload]
            executable=path,
            stdin=stdin,
            stdout=fds[-2],
            stderr=fds[-1],
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        popen_pid: int = child.pid
        children[popen_pid] = child
        return popen_pid
    os.chdir(cwd)  # type: ignore[arg-type]
    actions: list[tuple[int, ...] | tuple[int, int, str, int, int]]
    if request["stdin"]:
        actions = [(os.POSIX_SPAWN_DUP2, fds[0], 0)]
    else:
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
    actions += [(os.POSIX_SPAWN_DUP2, fds[-2], 1), (os.POSIX_SPAWN_DUP2, fds[-1], 2)]
    pid = os.posix_spawn(
        path,
        argv,  # type: ignore[arg-type]
        env,  # type: ignore[arg-type]
        file_actions=actions,
        setsid=True,
        setsigdef=_RESTORED_SIGNALS,
    )
    children[pid] = None
    return pid


def _program_path(argv: list[str], env: dict[str, str]) -> str | None:
    """Where execvp would find ``argv[0]``, found by stats: under gVisor each directory
    of PATH without it cost a failed execve (``true``: three, 2-7 ms in all; the stats
    0.02 ms). None where that cannot be known here (a path given; a relative directory
    in PATH, which is the child's cwd's) or nothing is found: then execvp searches, and
    fails as it does."""
    name = argv[0] if argv and isinstance(argv[0], str) else ""
    if not name or "/" in name:
        return None
    for directory in env.get("PATH", os.defpath).split(os.pathsep):
        if not directory.startswith("/"):
            return None
        candidate = os.path.join(directory, name)
        try:
            found = stat.S_ISREG(os.stat(candidate).st_mode)
        except (OSError, ValueError):
            continue
        if found and os.access(candidate, os.X_OK):  # as execvp: the next on EACCES
            return candidate
    return None


def _reap(sock: socket.socket, children: dict[int, _Child]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        child = children.pop(pid, None)
        if child is not None:
            child.returncode = code  # reaped here: Popen must never wait for it again
        _answer(sock, {"exit": pid, "code": code})


def _answer(sock: socket.socket, answer: dict[str, object]) -> None:
    sock.send(json.dumps(answer).encode())


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), posix_spawn=POPEN_ONLY not in sys.argv[2:])
