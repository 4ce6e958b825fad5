"""The guest's end of the byte stream: a virtio-serial port or stdin/stdout.

Everything runs on the event loop over non-blocking file descriptors, no threads:

- Reading: a virtio-serial read returns at most one receive buffer (4 KiB), so on
  readiness we read repeatedly until EAGAIN or ``READ_BATCH_BYTES`` and hand the batch
  to ``on_bytes`` once. With O_NONBLOCK a read of 0 bytes means "no host connected"
  (the port polls HUP then): reported once through ``on_hangup``, then we poll again
  every ``DISCONNECTED_POLL_S``. For pipes (``reconnecting=False``) 0 bytes is the end.
- Writing: a blocking virtio-serial write busy-waits in the kernel until the host took
  the buffer; a non-blocking one returns at once (EAGAIN when the virtqueue is full, we
  then wait for POLLOUT). ``send_nowait`` writes what it can immediately, the rest is
  queued in order; ``send`` waits while more than ``MAX_PENDING_WRITE_BYTES`` are queued,
  so a slow host backs up into the senders, never into memory.

The virtio port can be opened only once, so reads and writes share one fd there.
"""

from __future__ import annotations

import asyncio
import errno
import glob
import logging
import os
from collections import deque
from collections.abc import Callable

__all__ = ["Transport", "TransportClosed", "find_port"]

_log = logging.getLogger("spaced.transport")

#: Bytes read per readiness event before the batch is handed on (many 4 KiB buffers).
READ_BATCH_BYTES = 256 * 1024
#: Bytes queued for writing before ``send`` waits.
MAX_PENDING_WRITE_BYTES = 4 * 1024 * 1024
#: Pause between reads while no host is connected (the port polls HUP, reads 0, then).
DISCONNECTED_POLL_S = 0.05
#: Size of the pieces reads are split into: one virtio-serial receive buffer (a page).
_PIECE = 4096
#: Most bytes one virtio-serial write takes (the driver cuts longer writes).
_WRITE_PIECE = 32 * 1024
#: Queued frames smaller than this are merged into one write (one virtqueue buffer).
_COALESCE_BYTES = 32 * 1024


class TransportClosed(Exception):
    """The stream ended for good (stdio EOF or a write error on a pipe)."""


def find_port(name: str, sys_root: str = "/sys/class/virtio-ports") -> str | None:
    """Return /dev/<port> for the virtio-serial port called ``name``, if there is one."""
    for path in sorted(glob.glob(os.path.join(sys_root, "*", "name"))):
        try:
            with open(path, encoding="utf-8") as file:
                if file.read().strip() == name:
                    return os.path.join("/dev", os.path.basename(os.path.dirname(path)))
        except OSError:
            continue
    return None


class Transport:
    """Frames' bytes in and out of one pair of (possibly identical) file descriptors.

    ``reconnecting`` (virtio-serial): a read of 0 bytes means "no host now", reported
    once through ``on_hangup``; bytes queued for that host are dropped and reading
    resumes when a host connects. Otherwise a read of 0 bytes is the end (``on_eof``).
    The fds are switched to non-blocking mode.
    """

    def __init__(self, read_fd: int, write_fd: int, *, reconnecting: bool) -> None:
        self._read_fd = read_fd
        self._write_fd = write_fd
        self._reconnecting = reconnecting
        self._loop: asyncio.AbstractEventLoop | None = None
        # Reused for every read: ``on_bytes`` must copy what it keeps.
        self._read_view = memoryview(bytearray(READ_BATCH_BYTES))
        self._all_iovecs = self._iovecs_from(0)
        self._out: deque[memoryview] = deque()
        self._head_partial = False  # the first queued item is partly written
        self._pending_bytes = 0
        self._writing = False  # a writer callback is registered
        self._connected = False
        self._drained = asyncio.Event()
        self._drained.set()
        self._callbacks: tuple[Callable[[bytes], None], Callable[[], None], Callable[[], None]]
        self._closed = False
        self.generation = 0
        self.on_write_error: Callable[[OSError], None] = lambda exc: None
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)

    def start(
        self,
        on_bytes: Callable[[bytes], None],
        on_hangup: Callable[[], None],
        on_eof: Callable[[], None],
    ) -> None:
        """Start reading; ``on_bytes`` gets a memoryview valid only during the call."""
        self._loop = asyncio.get_running_loop()
        self._callbacks = (on_bytes, on_hangup, on_eof)
        self._loop.add_reader(self._read_fd, self._on_readable)

    # -- reading --

    def _on_readable(self) -> None:
        on_bytes, _, _ = self._callbacks
        view = self._read_view
        size = count = 0
        ended = False
        error: OSError | None = None
        while size < READ_BATCH_BYTES:
            try:
                count = os.readv(self._read_fd, self._iovecs(size, count))
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError as exc:
                ended, error = True, exc
                break
            if count == 0:
                ended = True
                break
            size += count
        if size:
            self._connected = True
            on_bytes(view[:size])  # type: ignore[arg-type]
        if ended:
            self._on_end(error)

    def _iovecs(self, start: int, last: int) -> list[memoryview]:
        """The free part of the read buffer as 4 KiB pieces.

        A virtio-serial read returns at most one receive buffer (4 KiB, and full under
        load), but readv calls it once per piece until one comes up short: so one
        syscall gathers many buffers. Pipes fill the pieces in one go anyway. After a
        short read (``last`` not whole pieces: the host had sent no more) the next read
        most likely finds nothing: one piece then, not a list of sixty made per frame.
        """
        if start == 0:
            return self._all_iovecs
        if last % _PIECE:
            return [self._read_view[start:]]
        return self._iovecs_from(start)

    def _iovecs_from(self, start: int) -> list[memoryview]:
        view = self._read_view
        return [view[offset : offset + _PIECE] for offset in range(start, READ_BATCH_BYTES, _PIECE)]

    def _on_end(self, error: OSError | None) -> None:
        assert self._loop is not None
        _, on_hangup, on_eof = self._callbacks
        if not self._reconnecting:
            if error is not None:
                _log.error("read failed: %s", error)
            self._loop.remove_reader(self._read_fd)
            on_eof()
            return
        if self._connected:
            self._connected = False
            self._drop_output()
            on_hangup()
        # The port polls HUP (always readable) while no host is connected: back off.
        self._loop.remove_reader(self._read_fd)
        self._loop.call_later(DISCONNECTED_POLL_S, self._resume_reading)

    def _resume_reading(self) -> None:
        if not self._closed and self._loop is not None:
            self._loop.add_reader(self._read_fd, self._on_readable)

    # -- writing --

    def send_nowait(self, data: bytes | bytearray, generation: int) -> None:
        """Queue bytes of a session (small control frames: no waiting)."""
        if generation != self.generation or self._closed:
            return
        self._out.append(memoryview(data))
        self._pending_bytes += len(data)
        if not self._writing:
            self._flush()
        if self._pending_bytes > MAX_PENDING_WRITE_BYTES:
            self._drained.clear()

    async def send(self, data: bytes | bytearray, generation: int) -> None:
        """Queue bytes of a session; waits while too much is queued (a slow host).

        Bytes of a generation older than the current one are dropped, so a new session
        never sees frames of the previous one.
        """
        await self._drained.wait()
        self.send_nowait(data, generation)

    def new_generation(self) -> int:
        """Start a new session: frames queued for earlier sessions are dropped.

        A frame already partly written is finished, or the byte stream would tear.
        """
        self.generation += 1
        keep = self._out[0] if self._out and self._head_partial else None
        self._drop_output()
        if keep is not None:
            self._out.append(keep)
            self._pending_bytes = len(keep)
            self._wait_writable()
        return self.generation

    def _flush(self) -> None:
        """Write queued bytes until done or EAGAIN (then wait for POLLOUT)."""
        out = self._out
        try:
            while out:
                if self._write_head() is None:
                    self._wait_writable()
                    return
        except OSError as exc:
            self._drop_output()
            self.on_write_error(exc)
            return
        self._stop_waiting_writable()

    def _write_head(self) -> int | None:
        """Write (part of) the first queued item; None on EAGAIN."""
        out = self._out
        view = out[0]
        if len(view) < _COALESCE_BYTES and len(out) > 1:
            view = self._coalesce()
        try:
            if len(view) > _WRITE_PIECE:
                # A virtio-serial write takes at most 32 KiB; writev hands it the pieces
                # one by one, so one syscall queues the whole frame.
                pieces = range(0, len(view), _WRITE_PIECE)
                written = os.writev(self._write_fd, [view[o : o + _WRITE_PIECE] for o in pieces])
            else:
                written = os.write(self._write_fd, view)
        except BlockingIOError:
            return None
        except InterruptedError:
            return 0
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                return None
            raise
        self._pending_bytes -= written
        if written == len(view):
            out.popleft()
            self._head_partial = False
        else:
            out[0] = view[written:]
            self._head_partial = True
        if self._pending_bytes <= MAX_PENDING_WRITE_BYTES // 2:
            self._drained.set()
        return written

    def _coalesce(self) -> memoryview:
        """Merge small queued items at the head into one (fewer syscalls and kicks)."""
        out = self._out
        parts: list[memoryview] = []
        size = 0
        while out and size + len(out[0]) <= _COALESCE_BYTES:
            parts.append(out.popleft())
            size += len(parts[-1])
        merged = memoryview(b"".join(parts))
        out.appendleft(merged)
        return merged

    def _wait_writable(self) -> None:
        if not self._writing and self._loop is not None:
            self._writing = True
            self._loop.add_writer(self._write_fd, self._flush)

    def _stop_waiting_writable(self) -> None:
        if self._writing and self._loop is not None:
            self._writing = False
            self._loop.remove_writer(self._write_fd)

    def _drop_output(self) -> None:
        self._out.clear()
        self._head_partial = False
        self._pending_bytes = 0
        self._drained.set()
        self._stop_waiting_writable()

    async def close(self) -> None:
        self._closed = True
        self._drop_output()
        if self._loop is not None:
            self._loop.remove_reader(self._read_fd)
