"""A process's standard streams: pipes, or a pseudo-terminal (issue 20).

``ProcessIo`` is where a started process's output comes from (``sources``) and where
input written later goes (``write``/``close``, for processes started with
``open_stdin`` or ``pty``). With a PTY the process gets the slave side as stdin, stdout
and stderr and as its controlling terminal, so its output is one stream (OUTPUT), a
0x03 written as input is the terminal's interrupt (SIGINT to the foreground process
group), and ``resize`` sets the window size (the kernel sends SIGWINCH).

Input waits for the process to take it, at most ``INPUT_TIMEOUT_S``; concurrent writers
are served one whole write after the other (``lock``), so pieces never interleave.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import struct
import termios
from collections.abc import Callable

from space.protocol import Channel, ErrorCode

from ._errors import OpError

__all__ = ["INPUT_TIMEOUT_S", "FdSource", "ProcessIo", "open_pty", "take_terminal"]

#: How long a write of input may wait for the process to read (a pipe or terminal
#: buffer holds 4-64 KiB): past it the write fails with ``timeout``.
INPUT_TIMEOUT_S = 30.0
#: The terminal's EOF character (VEOF, Ctrl-D): how a PTY's input is "closed".
_CTRL_D = b"\x04"


class FdSource:
    """A non-blocking file descriptor read (and written) through the loop directly: a
    pipe a process writes its output to, or a PTY's master side.

    Cheaper than asyncio's pipe transports (no protocol, no connection callbacks, a
    read tried before any wait): per exec that was loop turns and bytecode, all of it
    emulated under TCG (issue 21). ``close`` closes it (ProcessIo.release).
    """

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.closed = False

    async def _ready(self, add: Callable[..., None], remove: Callable[[int], bool]) -> None:
        # Registered only while waiting: a level-triggered reader left registered would
        # spin the loop while a slow consumer holds back the next read.
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def ready() -> None:
            if not future.done():
                future.set_result(None)

        add(self.fd, ready)
        try:
            await future
        finally:
            remove(self.fd)

    def read_now(self, n: int) -> bytes | None:
        """Up to ``n`` bytes if some are there now; None if none yet; b"" at EOF (a
        PTY's: every holder of its slave side closed it, EIO)."""
        if self.closed:
            return b""
        try:
            return os.read(self.fd, n)
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno == errno.EIO:
                return b""
            raise

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes, waiting for some; b"" at EOF."""
        loop = asyncio.get_running_loop()
        while (data := self.read_now(n)) is None:
            await self._ready(loop.add_reader, loop.remove_reader)
        return data

    async def write(self, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except BlockingIOError:
                await self._ready(loop.add_writer, loop.remove_writer)

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)


def open_pty(rows: int, cols: int) -> tuple[FdSource, int]:
    """A new PTY of ``rows`` x ``cols``: (master, slave fd). The caller closes the slave
    once the process holds it."""
    master, slave = os.openpty()
    pty = FdSource(master)
    pty.resize(rows, cols)
    return pty, slave


def take_terminal() -> None:
    """In the child (preexec_fn, after setsid): make stdin, the PTY's slave side, our
    controlling terminal, so Ctrl-C and SIGWINCH reach the process group."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class ProcessIo:
    """Output sources and the input sink of one process (see the module docstring)."""

    def __init__(
        self,
        sources: list[tuple[Channel, FdSource]],
        *,
        stdin: asyncio.StreamWriter | None = None,
        pty: FdSource | None = None,
    ) -> None:
        self.sources = sources
        self.lock = asyncio.Lock()
        self._stdin = stdin
        self._pty = pty
        self._input_open = stdin is not None or pty is not None
        self._exited = False

    @property
    def pty(self) -> bool:
        return self._pty is not None

    def check_input(self) -> None:
        """Raise conflict unless input can be written now."""
        if self._exited:
            raise OpError(ErrorCode.CONFLICT, "the process has exited")
        if self._stdin is None and self._pty is None:
            raise OpError(ErrorCode.CONFLICT, "the process was started without open_stdin or pty")
        if not self._input_open:
            raise OpError(ErrorCode.CONFLICT, "the process's stdin is closed")

    async def write(self, data: bytes) -> None:
        """Write all of ``data``; raises conflict (stdin gone) or timeout (not read)."""
        self.check_input()
        try:
            async with asyncio.timeout(INPUT_TIMEOUT_S):
                if self._pty is not None:
                    await self._pty.write(data)
                elif self._stdin is not None:
                    self._stdin.write(data)
                    await self._stdin.drain()
        except TimeoutError:
            raise OpError(
                ErrorCode.TIMEOUT, f"the process read no input for {INPUT_TIMEOUT_S} s"
            ) from None
        except (BrokenPipeError, ConnectionResetError):
            self._input_open = False
            raise OpError(ErrorCode.CONFLICT, "the process closed its stdin") from None
        except OSError as exc:
            if exc.errno == errno.EIO:  # a PTY whose every holder is gone
                raise OpError(ErrorCode.CONFLICT, "the process has exited") from None
            raise

    async def close_input(self) -> None:
        """EOF: a pipe is closed; a PTY gets the EOF character (Ctrl-D), as typed."""
        self.check_input()
        if self._pty is not None:
            await self.write(_CTRL_D)
            return
        self._input_open = False
        if self._stdin is not None:
            with contextlib.suppress(OSError):
                self._stdin.close()

    def resize(self, rows: int, cols: int) -> None:
        if self._pty is None:
            raise OpError(ErrorCode.CONFLICT, "the process has no pty")
        if self._exited:
            raise OpError(ErrorCode.CONFLICT, "the process has exited")
        self._pty.resize(rows, cols)

    def exited(self) -> None:
        """The process ended: later input is refused; the pipe is closed."""
        self._exited = True
        if self._stdin is not None and self._input_open:
            self._input_open = False
            with contextlib.suppress(OSError):
                self._stdin.close()

    def release(self) -> None:
        """Close the output's fds (a PTY's too) once drained (or given up)."""
        self.exited()
        for _, source in self.sources:
            source.close()
