"""The guest's end of the byte stream: a virtio-serial port or stdin/stdout.

Reads happen in a thread (virtio-serial reads return 0 at once while no host is
connected, which asyncio's pipe transports would take for EOF); writes go through one
writer task and a one-thread executor so frames are never interleaved and a slow host
backs up into ``send`` instead of into memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import glob
import logging
import os
import threading
import time
from collections.abc import Callable

__all__ = ["Transport", "TransportClosed", "find_port"]

_log = logging.getLogger("spaced.transport")

#: Most bytes read in one go (a few maximal frames).
READ_BYTES = 1024 * 1024
#: Reads handed to the loop but not yet processed before the reader thread waits.
MAX_PENDING_READS = 8
#: Bytes queued for writing before ``send`` waits.
MAX_PENDING_WRITE_BYTES = 4 * 1024 * 1024
#: Pause between reads while no host is connected (the port reads 0 at once then).
DISCONNECTED_POLL_S = 0.05


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
    """Frames' bytes in and out of one pair of file descriptors.

    ``reconnecting`` (virtio-serial): a read of 0 bytes means "no host now", reported
    once through ``on_hangup``, and reading resumes when a host connects. Otherwise a
    read of 0 bytes is the end (``on_eof``).
    """

    def __init__(self, read_fd: int, write_fd: int, *, reconnecting: bool) -> None:
        self._read_fd = read_fd
        self._write_fd = write_fd
        self._reconnecting = reconnecting
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots = threading.Semaphore(MAX_PENDING_READS)
        self._queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        self._pending_bytes = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "spaced-writer")
        self._writer: asyncio.Task[None] | None = None
        self.generation = 0
        self.on_write_error: Callable[[OSError], None] = lambda exc: None

    def start(
        self,
        on_bytes: Callable[[bytes], None],
        on_hangup: Callable[[], None],
        on_eof: Callable[[], None],
    ) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._writer = loop.create_task(self._write_loop())
        args = (loop, on_bytes, on_hangup, on_eof)
        threading.Thread(
            target=self._read_loop, args=args, name="spaced-reader", daemon=True
        ).start()

    def _read_loop(
        self,
        loop: asyncio.AbstractEventLoop,
        on_bytes: Callable[[bytes], None],
        on_hangup: Callable[[], None],
        on_eof: Callable[[], None],
    ) -> None:
        connected = False
        while True:
            try:
                data = os.read(self._read_fd, READ_BYTES)
            except OSError as exc:
                if not self._reconnecting:
                    _log.error("read failed: %s", exc)
                    data = b""
                else:
                    data, connected = self._hangup(loop, on_hangup, connected)
                    continue
            if data:
                connected = True
                self._slots.acquire()
                loop.call_soon_threadsafe(self._deliver, on_bytes, data)
            elif self._reconnecting:
                _, connected = self._hangup(loop, on_hangup, connected)
            else:
                loop.call_soon_threadsafe(on_eof)
                return

    @staticmethod
    def _hangup(
        loop: asyncio.AbstractEventLoop, on_hangup: Callable[[], None], connected: bool
    ) -> tuple[bytes, bool]:
        if connected:
            loop.call_soon_threadsafe(on_hangup)
        time.sleep(DISCONNECTED_POLL_S)
        return b"", False

    def _deliver(self, on_bytes: Callable[[bytes], None], data: bytes) -> None:
        try:
            on_bytes(data)
        finally:
            self._slots.release()

    def send_nowait(self, data: bytes, generation: int) -> None:
        """Queue bytes of a session (small control frames: no waiting)."""
        self._queue.put_nowait((generation, data))
        self._pending_bytes += len(data)
        if self._pending_bytes > MAX_PENDING_WRITE_BYTES:
            self._drained.clear()

    async def send(self, data: bytes, generation: int) -> None:
        """Queue bytes of a session; waits while too much is queued (a slow host).

        Bytes of a generation older than the current one when they reach the writer are
        dropped, so a new session never sees frames of the previous one.
        """
        await self._drained.wait()
        self.send_nowait(data, generation)

    def new_generation(self) -> int:
        """Start a new session: bytes queued for earlier sessions are dropped."""
        self.generation += 1
        return self.generation

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < 64:
                batch.append(self._queue.get_nowait())
            size = sum(len(data) for _, data in batch)
            payload = b"".join(data for gen, data in batch if gen == self.generation)
            try:
                if payload:
                    await loop.run_in_executor(self._executor, _write_all, self._write_fd, payload)
            except OSError as exc:
                self.on_write_error(exc)
            finally:
                self._pending_bytes -= size
                if self._pending_bytes <= MAX_PENDING_WRITE_BYTES // 2:
                    self._drained.set()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
