"""The spawner helper: runs as one account and starts its processes for spaced.

``python3 -m space.guest._spawn_helper FD`` (space.guest._spawner starts it and says
why). It imports as little as it can: it lives as long as the sandbox, one per account.
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

__all__ = ["MAX_REQUEST_BYTES", "NAME", "serve"]

#: A request bigger than this (a huge environment) spaced spawns itself: a datagram of
#: the socketpair must fit the socket's buffer.
MAX_REQUEST_BYTES = 64 * 1024
#: The helper's process name (``comm``): ``pkill python3`` or ``killall python3`` in a
#: sandbox pass it by.
NAME = b"spaced-spawner"
_PR_SET_NAME = 15


def serve(sock: socket.socket) -> None:
    """Answer spaced's requests until it closes the socket; report every child's exit."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, NAME, 0, 0, 0)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    children: dict[int, subprocess.Popen[bytes]] = {}
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
            if not data:
                return  # spaced closed its end: the children live on
            try:
                _start(sock, json.loads(data), fds, children)
            finally:
                for fd in fds:
                    os.close(fd)


def _start(
    sock: socket.socket,
    request: dict[str, object],
    fds: list[int],
    children: dict[int, subprocess.Popen[bytes]],
) -> None:
    stdin: int = fds[0] if request["stdin"] else subprocess.DEVNULL
    try:
        # No uid change, no preexec_fn: CPython vforks.
        child = subprocess.Popen(
            request["argv"],  # type: ignore[call-overload]
            executable=_program_path(request["argv"], request["env"]),  # type: ignore[arg-type]
            stdin=stdin,
            stdout=fds[-2],
            stderr=fds[-1],
            cwd=request["cwd"],
            env=request["env"],
            start_new_session=True,
        )
    except OSError as exc:
        filename = exc.filename if isinstance(exc.filename, str) else None
        text = (exc.strerror or str(exc))[:512]
        _answer(sock, {"errno": exc.errno or errno.EINVAL, "error": text, "filename": filename})
    except (ValueError, TypeError, subprocess.SubprocessError) as exc:
        _answer(sock, {"errno": errno.EINVAL, "error": str(exc)[:512], "filename": None})
    else:
        children[child.pid] = child
        _answer(sock, {"pid": child.pid})


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


def _reap(sock: socket.socket, children: dict[int, subprocess.Popen[bytes]]) -> None:
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
    serve(socket.socket(fileno=int(sys.argv[1])))
