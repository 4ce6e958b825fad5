"""``space exec -i`` and ``-it`` (issue 20): our stdin streamed to a command as it
comes, or a terminal session in a sandbox.

With ``-i`` alone, stdin (a pipe, a file, a terminal line by line) is read in pieces
and each piece written to the command's stdin as it arrives, then closed at its end:
``tail -f log | space exec -i ID -- grep x`` works, whatever the size.

The command runs on a pseudo-terminal in the guest the size of ours; our terminal goes
to raw mode (every key, Ctrl-C included, is sent as typed: a 0x03 reaches the guest's
terminal, which interrupts the command there, not this client), its SIGWINCH becomes a
resize, and its mode is restored however the session ends. Keys travel as one request
per read of the terminal (docs/api.md, "Interactive processes"). The exec stream is a
foreground one: if this client goes away, the API kills the command.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import termios
import threading
import tty
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any, BinaryIO

from space.sdk import CommandHandle, CommandResult, PtySize, Sandbox
from space.sdk.errors import Conflict, NotFound, SpaceError

__all__ = ["run_piped", "run_terminal", "stdin_reader", "stdout_writer"]

#: Most bytes read from the terminal per request (a paste arrives in a few of them).
_READ_BYTES = 64 * 1024
#: How often the input loop looks at the session's end and at a pending resize.
_POLL_S = 0.1


def stdin_reader(stdin: BinaryIO) -> Callable[[int], bytes]:
    """How to read ``stdin`` in pieces: ``os.read`` on its descriptor, which holds no
    lock of the interpreter's (a daemon thread blocked in a buffered read can make the
    interpreter's exit fail), else the stream's own ``read1`` (no descriptor: a test's)."""
    try:
        fd = stdin.fileno()
    except (OSError, ValueError):
        return stdin.read1  # type: ignore[attr-defined,no-any-return]
    return lambda size: os.read(fd, size)


def run_piped(
    sandbox: Sandbox,
    command: str | Sequence[str],
    *,
    read: Callable[[int], bytes],
    **options: Any,
) -> CommandResult:
    """Run ``command`` (``options`` as commands.run's) with what ``read`` gives streamed
    to its stdin, piece by piece, then closed (``read`` answers b"" at the end)."""

    def started(handle: CommandHandle) -> None:  # on the SDK's loop: hand over at once
        feeder = threading.Thread(
            target=_feed, args=(handle, read), name="space-exec-stdin", daemon=True
        )
        feeder.start()

    result: CommandResult = sandbox.commands.run(
        command, open_stdin=True, on_start=started, **options
    )
    return result


def _feed(handle: CommandHandle, read: Callable[[int], bytes]) -> None:
    try:
        while chunk := read(_READ_BYTES):  # as it comes, not the whole
            handle.send_stdin(chunk)
        handle.close_stdin()
    except SpaceError:
        pass  # the command ended first (or the run failed, which the run reports)


def run_terminal(
    sandbox: Sandbox,
    command: str | Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | None,
    user: str | None,
    timeout_s: float | None,
    stdin_fd: int,
    write: Callable[[str], object],
) -> CommandResult:
    """Run ``command`` on a PTY, forwarding ``stdin_fd`` (a terminal) until it ends.

    Raises whatever the run raised (SpaceError leaves); the terminal's mode is restored.
    """
    session = _Session(sandbox, stdin_fd)
    options: dict[str, Any] = {"env": dict(env), "cwd": cwd, "user": user, "timeout_s": timeout_s}
    with _raw(stdin_fd), _on_resize(session.resized.set):
        session.start(command, options, write)
        session.forward()
    return session.result()


class _Session:
    def __init__(self, sandbox: Sandbox, fd: int) -> None:
        self._sandbox = sandbox
        self._fd = fd
        self._handle: CommandHandle | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        self.resized = threading.Event()
        self._outcome: list[CommandResult | BaseException] = []
        self._thread: threading.Thread | None = None

    def start(
        self, command: str | Sequence[str], options: dict[str, Any], write: Callable[[str], object]
    ) -> None:
        def started(handle: CommandHandle) -> None:
            self._handle = handle
            self._started.set()

        def run() -> None:
            try:
                size = _size(self._fd)
                self._outcome.append(
                    self._sandbox.commands.run(
                        command, pty=size, on_start=started, on_stdout=write, **options
                    )
                )
            except BaseException as exc:  # handed to the main thread, raised there
                self._outcome.append(exc)
            finally:
                self._started.set()
                self._done.set()

        self._thread = threading.Thread(target=run, name="space-exec-tty", daemon=True)
        self._thread.start()
        self._started.wait()

    def forward(self) -> None:
        """Send what the terminal gives until the command ends (or our input does)."""
        handle = self._handle
        while handle is not None and not self._done.is_set():
            if self.resized.is_set():
                self.resized.clear()
                with contextlib.suppress(Conflict, NotFound):
                    handle.resize(_size(self._fd))
            ready, _, _ = select.select([self._fd], [], [], _POLL_S)
            if not ready:
                continue
            data = os.read(self._fd, _READ_BYTES)
            try:
                if data:
                    handle.send_stdin(data)
                else:  # our stdin ended: so does the command's
                    handle.close_stdin()
                    break
            except (Conflict, NotFound):
                break  # the command ended meanwhile
        if self._thread is not None:
            self._thread.join()

    def result(self) -> CommandResult:
        outcome = self._outcome[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def _size(fd: int) -> PtySize:
    try:
        cols, rows = os.get_terminal_size(fd)
    except OSError:
        cols, rows = shutil.get_terminal_size()
    # A terminal may report 0 x 0 (a serial line): the guest wants 1 to 1000.
    return PtySize(rows=min(rows or 24, 1000), cols=min(cols or 80, 1000))


@contextlib.contextmanager
def _raw(fd: int) -> Iterator[None]:
    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def _on_resize(callback: Callable[[], None]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only: no resizes then
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        callback()

    previous = signal.signal(signal.SIGWINCH, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGWINCH, previous)


def stdout_writer() -> Callable[[str], object]:
    """Write output as it comes (the guest's terminal already turned \\n into \\r\\n)."""

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    return write
