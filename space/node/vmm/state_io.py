"""What QEMU's migration stream goes through on its way to and from a ``vmstate`` file.

QEMU saves and loads a VM's state through a file descriptor handed over QMP. Without
a key that descriptor is the file itself. With the node's state key (issue 18) it is a
pipe, and a thread of the node seals what QEMU writes into the file
(space.node.vmm.sealed_state) or opens the file chunk by chunk and writes only
verified plaintext into the pipe QEMU reads: no plaintext touches the disk, and nothing
unverified reaches QEMU.

Use ``state_writer`` / ``state_reader`` as async context managers: hand ``qemu_fd`` to
QEMU, call ``handed_over`` (our copy of QEMU's end is closed, so QEMU's close is the
end of the stream), then ``finish``. Leaving the context, also by an error or a
cancellation, stops the thread at its next wait and closes every descriptor; the
thread waits on nothing but its pipe and a stop signal, so it ends promptly. A state
the save of which did not finish has no last chunk and never authenticates.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import select
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

from space.node.api import Timeout, Unavailable
from space.node.vmm.sealed_state import MAGIC, NotAuthentic, Sealer, is_sealed, open_chunks

__all__ = ["StateReader", "StateWriter", "state_reader", "state_writer"]

#: Pipe buffer: a sealed chunk's worth (Linux's default pipe-max-size for root), so a
#: pipe of 64 KiB does not make QEMU and the thread take turns 16 times per chunk.
_PIPE_BYTES = 1 << 20


class _Stopped(Exception):
    """The thread was asked to stop."""


class _Worker:
    """A thread running ``target(stop_fd)``, which must wait only with ``_wait``; the
    descriptor ``owned`` (the state file) is closed after the thread ends.

    ``failure`` is what it raised (set before it closes its pipe end, so whoever sees
    the pipe close sees the failure); ``done`` resolves on the loop when it returns.
    """

    def __init__(self, name: str, target: Callable[[int], None], *, owned: int) -> None:
        self._loop = asyncio.get_running_loop()
        self._owned = owned  # closed once the thread has ended
        self._stop_fd = os.eventfd(0, os.EFD_CLOEXEC)
        self.done: asyncio.Future[None] = self._loop.create_future()
        self.failure: BaseException | None = None
        self._target = target
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._target(self._stop_fd)
        except BaseException as exc:  # handed to the loop, raised there
            self.failure = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self._settle)

    def _settle(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    async def close(self) -> None:
        """Stop the thread, wait for it, close its descriptors; idempotent. A second
        cancellation leaves the closing to the thread's end."""
        if self._stop_fd < 0:
            return
        os.eventfd_write(self._stop_fd, 1)
        try:
            await asyncio.shield(self.done)
        finally:
            if self.done.done():
                self._release()
            else:
                self.done.add_done_callback(lambda _: self._release())

    def _release(self) -> None:
        # ``done`` is set as the thread's last act, so this join returns at once.
        self._thread.join()
        if self._stop_fd >= 0:
            os.close(self._stop_fd)
            os.close(self._owned)
            self._stop_fd = -1


def _wait(fd: int, events: int, stop_fd: int) -> None:
    """Block until ``fd`` has ``events`` (or is hung up or in error); _Stopped on stop."""
    poller = select.poll()
    poller.register(fd, events)
    poller.register(stop_fd, select.POLLIN)
    ready = dict(poller.poll())
    if stop_fd in ready:
        raise _Stopped


def _pipe() -> tuple[int, int]:
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):  # best effort: a smaller pipe only costs switches
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    return read_end, write_end


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class StateWriter:
    """Where QEMU writes a state: the file itself (no key)."""

    def __init__(self, fd: int, sandbox_id: str) -> None:
        self.qemu_fd = fd
        self._fd = fd
        self._sandbox_id = sandbox_id

    def handed_over(self) -> None:
        """QEMU holds its own copy of ``qemu_fd`` now."""

    def check(self) -> None:
        """Raise Unavailable if writing the file failed (the migration then fails too)."""

    async def finish(self, timeout_s: float) -> int:
        """Once QEMU completed the migration: make the file whole and durable; returns
        its size. Raises Unavailable or Timeout."""
        try:
            self._complete()
            os.fsync(self._fd)
            return os.fstat(self._fd).st_size
        except OSError as exc:
            raise Unavailable(
                f"writing the saved state failed: {exc}", sandbox_id=self._sandbox_id
            ) from exc

    def _complete(self) -> None:
        """Write what the file still lacks once QEMU's stream is whole."""

    async def aclose(self) -> None:
        os.close(self._fd)


class _SealingWriter(StateWriter):
    """QEMU writes into a pipe; a thread seals what it reads into the file."""

    def __init__(self, fd: int, sandbox_id: str, key: bytes) -> None:
        super().__init__(fd, sandbox_id)
        self._sealer = Sealer(key, lambda data: _write_all(fd, data))
        self._pipe_r, self.qemu_fd = _pipe()
        try:
            self._worker = _Worker(f"seal-{sandbox_id}", self._pump, owned=fd)
        except BaseException:
            os.close(self._pipe_r)
            os.close(self.qemu_fd)
            raise

    def _pump(self, stop_fd: int) -> None:
        try:
            while True:
                _wait(self._pipe_r, select.POLLIN, stop_fd)
                data = os.read(self._pipe_r, _PIPE_BYTES)
                if not data:  # QEMU closed its end: the migration is over
                    return
                self._sealer.update(data)
        finally:
            os.close(self._pipe_r)  # a failed write fails QEMU's next one (EPIPE) at once

    def handed_over(self) -> None:
        os.close(self.qemu_fd)
        self.qemu_fd = -1

    def check(self) -> None:
        failure = self._worker.failure
        if failure is not None and not isinstance(failure, _Stopped):
            raise Unavailable(
                f"writing the saved state failed: {failure}", sandbox_id=self._sandbox_id
            ) from failure

    async def finish(self, timeout_s: float) -> int:
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(self._worker.done)
        except TimeoutError as exc:
            raise Timeout(
                f"qemu did not close the state stream within {timeout_s} s",
                sandbox_id=self._sandbox_id,
            ) from exc
        self.check()
        return await super().finish(timeout_s)

    def _complete(self) -> None:
        self._sealer.finish()  # the last chunk: only now is the state whole

    async def aclose(self) -> None:
        if self.qemu_fd >= 0:
            os.close(self.qemu_fd)
            self.qemu_fd = -1
        await self._worker.close()


@contextlib.asynccontextmanager
async def state_writer(
    path: Path, key: bytes | None, *, sandbox_id: str
) -> AsyncIterator[StateWriter]:
    """A writer of ``path`` (created or truncated, mode 0600): sealed under ``key``, or
    plain without one. Raises Unavailable if the file cannot be opened or written."""
    # Never through a link: a gVisor sandbox's volume is its guest's root directory.
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    with _opened(path, flags, sandbox_id) as fd:
        writer = StateWriter(fd, sandbox_id) if key is None else _SealingWriter(fd, sandbox_id, key)
    try:
        yield writer
    finally:
        await writer.aclose()


@contextlib.contextmanager
def _opened(path: Path, flags: int, sandbox_id: str) -> Iterator[int]:
    """``path`` opened, for the block to hand to an owner; closed if the block raises.
    Raises Unavailable for an OSError."""
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise Unavailable(f"the saved state: {exc.strerror}", sandbox_id=sandbox_id) from exc
    try:
        yield fd
    except OSError as exc:
        os.close(fd)
        raise Unavailable(f"the saved state: {exc.strerror}", sandbox_id=sandbox_id) from exc
    except BaseException:
        os.close(fd)
        raise


class StateReader:
    """Where QEMU reads a state from: the file itself (plain)."""

    def __init__(self, fd: int, sandbox_id: str) -> None:
        self.qemu_fd = fd
        self._sandbox_id = sandbox_id

    def handed_over(self) -> None:
        """QEMU holds its own copy of ``qemu_fd`` now: ours is closed."""
        os.close(self.qemu_fd)
        self.qemu_fd = -1

    def check(self) -> None:
        """Raise Unavailable if the state did not authenticate (QEMU then fails too)."""

    async def finish(self, timeout_s: float) -> None:
        """Once QEMU loaded the state: raise if any of it did not authenticate."""

    async def aclose(self) -> None:
        if self.qemu_fd >= 0:
            os.close(self.qemu_fd)
            self.qemu_fd = -1


class _OpeningReader(StateReader):
    """A thread opens the sealed file chunk by chunk into the pipe QEMU reads."""

    def __init__(self, fd: int, sandbox_id: str, key: bytes) -> None:
        pipe_r, self._pipe_w = _pipe()
        super().__init__(pipe_r, sandbox_id)
        self._fd = fd
        self._key = key
        try:
            os.set_blocking(self._pipe_w, False)  # so a stop is seen between partial writes
            self._worker = _Worker(f"open-{sandbox_id}", self._pump, owned=fd)
        except BaseException:
            os.close(pipe_r)
            os.close(self._pipe_w)
            raise

    def _pump(self, stop_fd: int) -> None:
        try:
            for plaintext in open_chunks(self._key, lambda n: os.read(self._fd, n)):
                _wait(self._pipe_w, select.POLLOUT, stop_fd)  # a stop is seen per chunk
                view = memoryview(plaintext)
                while view:
                    try:
                        view = view[os.write(self._pipe_w, view) :]
                    except BlockingIOError:  # the pipe is full: QEMU reads on
                        _wait(self._pipe_w, select.POLLOUT, stop_fd)
        finally:
            # QEMU sees the end of its stream now; after a failure, a short one it
            # refuses (it has only ever read verified chunks).
            os.close(self._pipe_w)

    def check(self) -> None:
        failure = self._worker.failure
        if isinstance(failure, NotAuthentic):
            raise Unavailable(
                f"the saved state of sandbox {self._sandbox_id} does not authenticate: {failure}",
                sandbox_id=self._sandbox_id,
            ) from failure
        # A broken pipe is QEMU's exit, which the caller reports itself.
        if isinstance(failure, OSError) and not isinstance(failure, BrokenPipeError):
            raise Unavailable(
                f"reading the saved state failed: {failure}", sandbox_id=self._sandbox_id
            ) from failure

    async def finish(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(self._worker.done)
        self.check()

    async def aclose(self) -> None:
        await super().aclose()
        await self._worker.close()


@contextlib.asynccontextmanager
async def state_reader(
    path: Path, key: bytes | None, *, sandbox_id: str
) -> AsyncIterator[StateReader]:
    """A reader of the state in ``path``: opened under ``key`` if sealed.

    A file without the sealed-state magic is a plaintext state written before states
    were sealed (issue 18) and is handed to QEMU as it is: the upgrade path, which
    also means a plaintext file put in a volume is loaded. Raises Unavailable for a
    sealed state without a key, or a file that cannot be opened.
    """
    with _opened(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, sandbox_id) as fd:
        reader = _reader_for(fd, key, sandbox_id)
    try:
        yield reader
    finally:
        await reader.aclose()


def _reader_for(fd: int, key: bytes | None, sandbox_id: str) -> StateReader:
    if not is_sealed(os.pread(fd, len(MAGIC), 0)):
        return StateReader(fd, sandbox_id)
    if key is None:
        raise Unavailable("the saved state is sealed and this VM has no key", sandbox_id=sandbox_id)
    return _OpeningReader(fd, sandbox_id, key)
