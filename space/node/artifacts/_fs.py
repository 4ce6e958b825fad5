"""The filesystem backend: objects as files under one owner-only directory.

A put writes a temporary file (``.put-<random>`` beside the object; no object name
starts with ``.``), fsyncs it, renames it over the name and fsyncs the directory, so a
reader sees either no object, the old one or the whole new one, and a crash leaves at
most a temporary file (skipped by ``list``, swept by ``sweep_temporaries``). The
directory and everything under it is owner-only (0700 directories, 0600 files). The
final component is opened without following a link. Unlike S3, a name cannot be both
an object and a directory of others ("a" and "a/b"): the second put fails
(StoreUnavailable); bundles never do that.
"""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import stat
from collections.abc import AsyncGenerator, AsyncIterable, Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

from space.node.api import NotFound
from space.node.artifacts._store import (
    DEFAULT_MAX_OBJECT_BYTES,
    MAX_LIST_OBJECTS,
    READ_BYTES,
    ObjectInfo,
    ObjectTooLarge,
    StoreUnavailable,
    check_name,
    check_prefix,
)

__all__ = ["FilesystemStore"]

_TEMPORARY = ".put-"
_T = TypeVar("_T")


class FilesystemStore:
    """An ArtifactStore in the directory ``root`` (made 0700 if absent). Every file
    call runs in a thread."""

    def __init__(self, root: Path, *, max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> None:
        self.root = root
        self.max_object_bytes = max_object_bytes

    def __repr__(self) -> str:
        return f"FilesystemStore({str(self.root)!r})"

    def _path(self, name: str) -> Path:
        return self.root / check_name(name)

    async def put(self, name: str, pieces: AsyncIterable[bytes]) -> ObjectInfo:
        path = self._path(name)
        fd, temporary = await _settled(
            partial(_open_temporary, self.root, path), undo=lambda opened: _discard(*opened)
        )
        written = 0
        try:
            async for piece in pieces:
                written += len(piece)
                if written > self.max_object_bytes:
                    raise ObjectTooLarge(
                        f"artifact {name} is over {self.max_object_bytes} bytes; not stored"
                    )
                await _settled(partial(_write_all, fd, piece))
        except BaseException:
            _discard(fd, temporary)  # no thread uses fd any more (_settled)
            raise
        # _commit owns both from here; cancelled now, the object may yet land whole.
        await _settled(partial(_commit, fd, temporary, path))
        return ObjectInfo(name, written)

    async def get(self, name: str) -> AsyncGenerator[bytes, None]:
        path = self._path(name)
        fd = await _settled(partial(_open_object, path, name), undo=os.close)
        try:
            while piece := await _settled(partial(_read, fd, name)):
                yield piece
        finally:
            os.close(fd)  # no thread uses it any more (_settled)

    async def head(self, name: str) -> ObjectInfo | None:
        path = self._path(name)
        try:
            info = await asyncio.to_thread(os.lstat, path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise StoreUnavailable(f"cannot stat artifact {name}: {exc.strerror}") from None
        return ObjectInfo(name, info.st_size) if stat.S_ISREG(info.st_mode) else None

    async def exists(self, name: str) -> bool:
        return await self.head(name) is not None

    async def delete(self, name: str) -> None:
        path = self._path(name)
        try:
            await asyncio.to_thread(path.unlink, missing_ok=True)
        except NotADirectoryError:
            return
        except OSError as exc:
            raise StoreUnavailable(f"cannot delete artifact {name}: {exc.strerror}") from None

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_prefix(prefix)
        return await asyncio.to_thread(_list, self.root, prefix)

    async def sweep_temporaries(self) -> int:
        """Remove what puts interrupted by a crash left; how many files. Only safe while
        no put runs on this directory."""
        return await asyncio.to_thread(_sweep, self.root)


async def _settled(call: Callable[[], _T], *, undo: Callable[[_T], object] | None = None) -> _T:
    """``call()`` in a thread, never left running behind the caller: a cancellation
    waits for the thread to return (it may be using a descriptor the caller closes
    next), hands what it returned to ``undo``, and only then is raised."""
    future = asyncio.ensure_future(asyncio.to_thread(call))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait({future})  # a second cancellation gives up the wait
        if undo is not None and not future.cancelled() and future.exception() is None:
            undo(future.result())
        raise


def _read(fd: int, name: str) -> bytes:
    try:
        return os.read(fd, READ_BYTES)
    except OSError as exc:
        raise StoreUnavailable(f"cannot read artifact {name}: {exc.strerror}") from None


def _open_temporary(root: Path, path: Path) -> tuple[int, Path]:
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for parent in reversed(path.relative_to(root).parents[:-1]):
            (root / parent).mkdir(mode=0o700, exist_ok=True)
        temporary = path.with_name(f"{_TEMPORARY}{secrets.token_hex(8)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        return os.open(temporary, flags, 0o600), temporary
    except OSError as exc:
        raise StoreUnavailable(f"cannot write under {root}: {exc}") from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        raise StoreUnavailable(f"cannot write an artifact: {exc.strerror}") from None


def _commit(fd: int, temporary: Path, path: Path) -> None:
    """Make the temporary file the object, durably; closes ``fd`` and, failing, removes
    the temporary file."""
    try:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise StoreUnavailable(f"cannot store artifact {path.name}: {exc.strerror}") from None


def _discard(fd: int, temporary: Path) -> None:
    os.close(fd)
    temporary.unlink(missing_ok=True)


def _open_object(path: Path, name: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):  # ELOOP: a link
            raise NotFound(f"no artifact {name}") from None
        raise StoreUnavailable(f"cannot open artifact {name}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotFound(f"no artifact {name}")
    return fd


def _list(root: Path, prefix: str) -> list[ObjectInfo]:
    found: list[ObjectInfo] = []
    # Walk only the directory the prefix's whole segments name.
    start = root / prefix.rpartition("/")[0] if "/" in prefix else root
    for directory, subdirectories, files in os.walk(start, onerror=None):
        subdirectories[:] = sorted(d for d in subdirectories if not d.startswith("."))
        for file in files:
            if file.startswith("."):
                continue  # a put's temporary file
            path = Path(directory) / file
            name = path.relative_to(root).as_posix()
            if not name.startswith(prefix):
                continue
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue  # deleted meanwhile
            if stat.S_ISREG(info.st_mode):
                found.append(ObjectInfo(name, info.st_size))
            if len(found) > MAX_LIST_OBJECTS:
                raise ObjectTooLarge(f"over {MAX_LIST_OBJECTS} artifacts under {prefix!r}")
    return sorted(found, key=lambda info: info.name)


def _sweep(root: Path) -> int:
    swept = 0
    for directory, _, files in os.walk(root):
        for file in files:
            if file.startswith(_TEMPORARY):
                (Path(directory) / file).unlink(missing_ok=True)
                swept += 1
    return swept
