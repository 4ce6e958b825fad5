"""Packing a template's directory as a build context: a gzip'd tar, streamed.

``plan_context`` walks the directory first (nothing is sent until it is known to be
good): regular files and directories are taken; a symlink whose target is inside the
directory is followed (the archive holds what it points to), one pointing outside, a
symlink cycle and any other kind of file (FIFO, socket, device) raise InvalidArgument
naming the path. The spec is stored as ``space.toml`` at the root whatever its name.
``stream_context`` then writes the archive in a worker thread, handing over chunks
through a bounded queue, so no file is ever held whole in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
import tarfile
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path

from space.sdk.errors import InternalError, InvalidArgument

__all__ = ["SPEC_NAME", "Entry", "plan_context", "stream_context"]

SPEC_NAME = "space.toml"
_CHUNK_BYTES = 256 << 10
_QUEUE_CHUNKS = 8
_OPERATION = "template.build"


@dataclass(frozen=True, slots=True)
class Entry:
    """One archive entry: its name in the archive and the real file it is read from."""

    name: str
    source: Path
    is_dir: bool


def _refuse(message: str, path: Path) -> InvalidArgument:
    return InvalidArgument(message, operation=_OPERATION, details={"path": str(path)})


def plan_context(directory: Path, spec: str = SPEC_NAME) -> list[Entry]:
    """The entries of ``directory``'s build context, the spec first as ``space.toml``.

    Raises InvalidArgument: not a directory, spec missing or not a regular file (or
    outside the directory), a symlink pointing outside or in a cycle, a special file,
    an unreadable directory. Reads only metadata; changes nothing.
    """
    try:
        root = directory.resolve(strict=True)
        spec_path = (root / spec).resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise _refuse(f"cannot read {directory / spec}: {exc}", directory / spec) from None
    if not root.is_dir():
        raise _refuse(f"{directory} is not a directory", directory)
    if not spec_path.is_relative_to(root) or not spec_path.is_file():
        raise _refuse(f"the spec {spec!r} is not a regular file inside {root}", spec_path)
    entries = [Entry(SPEC_NAME, spec_path, False)]
    _walk(root, root, "", {root}, entries)
    return entries


def _walk(root: Path, directory: Path, prefix: str, parents: set[Path], out: list[Entry]) -> None:
    try:
        children = sorted(directory.iterdir())
    except OSError as exc:
        raise _refuse(f"cannot list {directory}: {exc.strerror}", directory) from None
    for child in children:
        name = prefix + child.name
        if name == SPEC_NAME:
            continue  # the root's space.toml is the spec's place, whatever the spec is
        real = _followed(root, child)
        mode = real.stat().st_mode
        if stat.S_ISDIR(mode):
            if real in parents:
                raise _refuse(f"symlink cycle: {child} leads back to {real}", child)
            out.append(Entry(name, real, True))
            _walk(root, real, name + "/", parents | {real}, out)
        elif stat.S_ISREG(mode):
            out.append(Entry(name, real, False))
        else:
            raise _refuse(f"{child} is neither a regular file nor a directory", child)


def _followed(root: Path, path: Path) -> Path:
    """``path`` resolved; InvalidArgument if it is a symlink leading outside ``root``."""
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise _refuse(f"cannot follow {path}: {exc}", path) from None
    if not real.is_relative_to(root):
        raise _refuse(f"symlink {path} points outside {root} (to {real})", path)
    return real


class _QueueWriter:
    """A file object for tarfile: gathers bytes and hands over chunks through ``put``."""

    def __init__(self, put: Callable[[bytes], None]) -> None:
        self._put = put
        self._pending = bytearray()

    def write(self, data: bytes) -> int:
        self._pending += data
        if len(self._pending) >= _CHUNK_BYTES:
            self.flush()
        return len(data)

    def flush(self) -> None:
        if self._pending:
            self._put(bytes(self._pending))
            self._pending.clear()


class _Abandoned(Exception):
    """The consumer went away: the packing thread stops."""


def _pack(entries: list[Entry], put: Callable[[bytes], None]) -> None:
    writer = _QueueWriter(put)
    with tarfile.open(fileobj=writer, mode="w|gz") as tar:  # type: ignore[call-overload]
        for entry in entries:
            info = tar.gettarinfo(str(entry.source), arcname=entry.name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if entry.is_dir:
                tar.addfile(info)
                continue
            with entry.source.open("rb") as source:
                tar.addfile(info, source)
    writer.flush()


async def stream_context(entries: list[Entry]) -> AsyncGenerator[bytes, None]:
    """The gzip'd tar of ``entries`` in chunks, packed in a worker thread.

    Raises InvalidArgument if a file cannot be read (or changed size) while packing.
    Closing the iterator early stops the thread.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(_QUEUE_CHUNKS)
    stop = threading.Event()

    def put(item: bytes | BaseException | None) -> None:
        if stop.is_set():
            raise _Abandoned
        asyncio.run_coroutine_threadsafe(queue.put(item), loop).result()

    def produce() -> None:
        try:
            _pack(entries, put)
            put(None)
        except _Abandoned:
            pass
        except OSError as exc:
            with contextlib.suppress(_Abandoned):
                put(_refuse(f"cannot pack {exc.filename or ''}: {exc.strerror or exc}", Path()))
        except Exception as exc:  # a bug: reported, never a hang
            with contextlib.suppress(_Abandoned):
                put(InternalError(f"packing failed: {exc!r}", operation=_OPERATION))

    worker = loop.run_in_executor(None, produce)
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while not worker.done():  # unblock a put waiting for room
            with contextlib.suppress(asyncio.QueueEmpty):
                queue.get_nowait()
            await asyncio.sleep(0.001)
