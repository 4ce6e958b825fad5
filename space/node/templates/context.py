"""Build contexts: the tar stream a template build arrives as, unpacked safely (issue 4).

A build context is a tar archive, plain or gzip'd (told apart by the gzip magic), holding
the spec as ``space.toml`` at its root and the files its copy steps name. It comes from a
tenant, so it is hostile until proved otherwise: only regular files and directories are
unpacked (symlinks, hard links, devices, FIFOs and sparse files are refused), member names
must be relative and stay inside the root, no path may appear twice, and nothing is ever
written through a link. Python 3.11.2 has no ``tarfile.data_filter``, so every rule is
checked here, and the bounds below hold before tarfile allocates anything big.

The archive is spooled to an unlinked temporary file next to ``dest`` (never held in
memory), then read by tarfile in streaming mode in a worker thread. Every problem with
the archive raises TemplateSpecError (``key`` "context", or ``file`` space.toml when the
spec itself is missing).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import io
import os
import tarfile
import tempfile
import threading
import zlib
from collections.abc import AsyncIterable, Callable, Iterator
from pathlib import Path
from typing import IO, ClassVar, NoReturn, Self

from space.node.templates.errors import TemplateSpecError

__all__ = [
    "MAX_ARCHIVE_BYTES",
    "MAX_ENTRIES",
    "MAX_FILE_BYTES",
    "MAX_PATH_BYTES",
    "SPEC_NAME",
    "unpack_context",
]

#: Files and directories one context may hold (a copy step's own limit, MAX_COPY_ENTRIES).
MAX_ENTRIES = 65536
#: Bytes of file contents one context may hold, all files together.
MAX_FILE_BYTES = 1 << 30
#: Bytes of the archive as uploaded (compressed, if gzip'd).
MAX_ARCHIVE_BYTES = 1 << 30
#: UTF-8 bytes of one member's name (Linux's PATH_MAX).
MAX_PATH_BYTES = 4096
SPEC_NAME = "space.toml"

#: A pax or GNU long-name header is read whole by tarfile: bound it before it is read.
_MAX_HEADER_BYTES = 64 * 1024
#: Extended headers (pax, GNU long name) one member may have before it.
_MAX_META_HEADERS = 3
#: Pax global headers one archive may hold: tarfile keeps every record of every one.
_MAX_GLOBAL_HEADERS = 16
#: Tar bytes a member may add beyond its contents (header, padding, pax records): with
#: MAX_FILE_BYTES it bounds the decompressed stream, so a gzip bomb stops early.
_MEMBER_OVERHEAD_BYTES = 8 * 1024
_CHUNK_BYTES = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"
_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE)
#: Headers that only describe the next member; tarfile reads their payload into memory.
_META_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME)
_HEADER_TYPES = (*_FILE_TYPES, tarfile.DIRTYPE, *_META_TYPES)
_TYPE_NAMES = {
    tarfile.SYMTYPE: "a symlink",
    tarfile.LNKTYPE: "a hard link",
    tarfile.GNUTYPE_LONGLINK: "a link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
    tarfile.CONTTYPE: "a contiguous file",
    tarfile.GNUTYPE_SPARSE: "a sparse file",
}
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _fail(problem: str) -> NoReturn:
    raise TemplateSpecError(None, "context", problem)


async def unpack_context(chunks: AsyncIterable[bytes], dest: Path) -> Path:
    """Unpack the build context read from ``chunks`` into ``dest``; return its space.toml.

    ``dest`` is an existing empty directory; its parent holds the spooled archive (an
    unlinked temporary file, gone on return) while it is read. Files keep their permission
    bits masked with 0o755; directories get theirs masked with 0o755 plus 0o700 (the node
    must be able to read and remove them); owners and times are not kept.

    Raises TemplateSpecError for any problem with the archive: larger than
    MAX_ARCHIVE_BYTES, neither a tar nor a gzip'd tar, truncated, more than MAX_ENTRIES
    members or MAX_FILE_BYTES of contents, a member that is not a regular file or a
    directory, a name that is absolute, has ``..``, a NUL, is not UTF-8 or is longer
    than MAX_PATH_BYTES, a path given twice, extended headers past their bounds, or no
    regular file ``space.toml`` at the root. OSError if writing the spool or ``dest``
    fails (a full disk). After an error or a cancellation ``dest`` may hold part of the
    archive: the caller removes it.
    """
    with tempfile.TemporaryFile(dir=dest.parent) as spool:
        await _spool(chunks, spool)
        await _in_thread(functools.partial(_unpack, spool, dest))
    return dest / SPEC_NAME


async def _spool(chunks: AsyncIterable[bytes], spool: IO[bytes]) -> None:
    """Copy ``chunks`` to ``spool`` in batches of about _CHUNK_BYTES, at most the limit."""
    total = 0
    batch = bytearray()
    async for chunk in chunks:
        total += len(chunk)
        if total > MAX_ARCHIVE_BYTES:
            _fail(f"archive larger than {MAX_ARCHIVE_BYTES} bytes (got {total} so far)")
        batch += chunk
        if len(batch) >= _CHUNK_BYTES:
            await asyncio.to_thread(spool.write, bytes(batch))
            batch.clear()
    await asyncio.to_thread(spool.write, bytes(batch))


class _Stopped(Exception):
    """The unpacking was cancelled: the worker thread stops at its next check."""


async def _in_thread(work: Callable[[threading.Event], None]) -> None:
    """Run ``work(stop)`` in a thread; on cancellation set ``stop`` and await its end.

    Awaiting the thread's end keeps it from writing into ``dest`` after the caller has
    moved on (and perhaps removed ``dest``).
    """
    stop = threading.Event()
    task = asyncio.ensure_future(asyncio.to_thread(work, stop))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        stop.set()
        with contextlib.suppress(Exception):
            await task
        raise


def _unpack(spool: IO[bytes], dest: Path, stop: threading.Event) -> None:
    spool.seek(0)
    compressed = spool.read(len(_GZIP_MAGIC)) == _GZIP_MAGIC
    spool.seek(0)
    source: gzip.GzipFile | IO[bytes] = (
        gzip.GzipFile(fileobj=spool, mode="rb") if compressed else spool
    )
    limit = MAX_FILE_BYTES + MAX_ENTRIES * _MEMBER_OVERHEAD_BYTES
    reader = _BoundedReader(source, limit, stop)
    try:
        with tarfile.open(
            fileobj=reader,
            mode="r|",
            tarinfo=_strict_tarinfo(),
            encoding="utf-8",
            errors="surrogateescape",
        ) as archive:
            _Extractor(dest, stop).run(archive)
    except (TemplateSpecError, _Stopped):
        raise
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, ValueError) as exc:
        kind = "gzip'd tar" if compressed else "tar"
        _fail(f"not a valid {kind} archive: {exc}")


class _BoundedReader:
    """The decompressed tar stream, cut off past ``limit`` bytes or once ``stop`` is set."""

    def __init__(
        self, source: gzip.GzipFile | IO[bytes], limit: int, stop: threading.Event
    ) -> None:
        self._source = source
        self._limit = limit
        self._stop = stop
        self._read = 0

    def read(self, size: int, /) -> bytes:
        if self._stop.is_set():
            raise _Stopped
        data = self._source.read(size)
        self._read += len(data)
        if self._read > self._limit:
            _fail(f"archive unpacks to more than {self._limit} bytes of tar")
        return data

    # The rest of tarfile's file protocol: a read-only stream that cannot seek.
    def write(self, data: bytes, /) -> int:
        raise io.UnsupportedOperation("write")

    def tell(self) -> int:
        return self._read

    def seek(self, position: int, /) -> int:
        raise io.UnsupportedOperation("seek")

    def close(self) -> None:
        """The source is the caller's to close."""


def _strict_tarinfo() -> type[_StrictTarInfo]:
    """A _StrictTarInfo class of its own for one archive: its counts start at zero."""

    class _ArchiveTarInfo(_StrictTarInfo):
        pass

    return _ArchiveTarInfo


class _StrictTarInfo(tarfile.TarInfo):
    """A TarInfo refusing, as each header is read, what tarfile would otherwise process.

    A refused type fails before its payload is read; a pax or long-name header larger
    than _MAX_HEADER_BYTES fails before tarfile reads it into memory; a truncated or
    corrupt header fails instead of silently ending the archive (tarfile's way past the
    first member). The class counts extended headers (tarfile reads a run of them by
    recursion and keeps every global one): use one class per archive, _strict_tarinfo;
    its headers are all read by one thread, in order.
    """

    _meta_run: ClassVar[int] = 0
    _global_headers: ClassVar[int] = 0

    @classmethod
    def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> Self:
        if len(buf) != tarfile.BLOCKSIZE:
            _fail("archive empty or truncated: it ends without the end-of-archive blocks")
        if not any(buf):
            # The end-of-archive block: tarfile's own error for it ends the archive.
            return super().frombuf(buf, encoding, errors)
        try:
            info = super().frombuf(buf, encoding, errors)
        except tarfile.HeaderError as exc:
            _fail(f"not a tar archive, or a corrupt one: a bad member header ({exc})")
        if info.type not in _HEADER_TYPES:
            kind = _TYPE_NAMES.get(info.type, f"of type {info.type!r}")
            _fail(f"member {info.name!r} is {kind}: only regular files and directories")
        if info.type in _META_TYPES and info.size > _MAX_HEADER_BYTES:
            _fail(f"an extended header of {info.size} bytes (at most {_MAX_HEADER_BYTES})")
        cls._count(info)
        return info

    @classmethod
    def _count(cls, info: tarfile.TarInfo) -> None:
        if info.type not in _META_TYPES:
            cls._meta_run = 0
            return
        cls._meta_run += 1
        if cls._meta_run > _MAX_META_HEADERS:
            _fail(f"more than {_MAX_META_HEADERS} extended headers before one member")
        if info.type == tarfile.XGLTYPE:
            cls._global_headers += 1
            if cls._global_headers > _MAX_GLOBAL_HEADERS:
                _fail(f"more than {_MAX_GLOBAL_HEADERS} pax global headers")

    # GNU sparse files described in pax headers: tarfile reads their maps unbounded
    # (version 1.0 reads lines until it has as many numbers as the header claims).
    def _proc_gnusparse_00(self, member: tarfile.TarInfo, *_: object) -> NoReturn:
        _fail(f"member {member.name!r} is a sparse file: only regular files and directories")

    _proc_gnusparse_01 = _proc_gnusparse_00
    _proc_gnusparse_10 = _proc_gnusparse_00


def _member_path(name: str) -> str:
    """``name`` normalised (no ``.`` or empty parts, no trailing ``/``); "" is the root.

    Raises TemplateSpecError for a NUL, a name that is not UTF-8 or is longer than
    MAX_PATH_BYTES, an absolute name, or a ``..`` part.
    """
    if "\x00" in name:
        _fail(f"member name {name!r} holds a NUL")
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        _fail(f"member name {name!r} is not UTF-8")
    if size > MAX_PATH_BYTES:
        _fail(f"member name of {size} bytes (at most {MAX_PATH_BYTES}): {name[:64]!r}...")
    if name.startswith("/"):
        _fail(f"member name {name!r} is absolute")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        _fail(f"member name {name!r} has '..'")
    return "/".join(parts)


class _Extractor:
    """Writes members under ``dest`` through directory fds, never following a link."""

    def __init__(self, dest: Path, stop: threading.Event) -> None:
        self._dest = dest
        self._stop = stop
        self._entries = 0
        self._file_bytes = 0
        #: Every path written: "file" or "dir" (a directory named or implied by a member).
        self._kinds: dict[str, str] = {}
        self._explicit: set[str] = set()
        self._dir_modes: dict[str, int] = {}

    def run(self, archive: tarfile.TarFile) -> None:
        while (member := archive.next()) is not None:
            self._entries += 1
            if self._entries > MAX_ENTRIES:
                _fail(f"more than {MAX_ENTRIES} members")
            if self._stop.is_set():
                raise _Stopped
            path = _member_path(member.name)
            self._claim(path, member)
            if member.type == tarfile.DIRTYPE:
                self._directory(path, member.mode)
            else:
                self._file(path, member, archive)
        self._finish()

    def _claim(self, path: str, member: tarfile.TarInfo) -> None:
        """Record ``path`` for ``member``; refuse a path given twice or under a file."""
        is_dir = member.type == tarfile.DIRTYPE
        if path in self._explicit or (not is_dir and path in self._kinds):
            _fail(f"member {member.name!r}: path {path or '.'!r} appears twice")
        if path == "" and not is_dir:
            _fail(f"member {member.name!r} is a file at the archive root's own path")
        parts = path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if self._kinds.get(parent) == "file":
                _fail(f"member {member.name!r}: {parent!r} is a file, not a directory")
            self._kinds[parent] = "dir"
        self._explicit.add(path)
        self._kinds[path] = "dir" if is_dir else "file"

    def _directory(self, path: str, mode: int) -> None:
        if path:
            with _opened_dir(self._dest, path, create=True):
                pass
            self._dir_modes[path] = (mode & 0o755) | 0o700

    def _file(self, path: str, member: tarfile.TarInfo, archive: tarfile.TarFile) -> None:
        self._file_bytes += member.size
        if self._file_bytes > MAX_FILE_BYTES:
            _fail(
                f"more than {MAX_FILE_BYTES} bytes of files:"
                f" {member.name!r} ({member.size} bytes) brings them to {self._file_bytes}"
            )
        parent, _, leaf = path.rpartition("/")
        source = archive.extractfile(member)
        assert source is not None  # a regular file always has contents
        with _opened_dir(self._dest, parent, create=True) as dir_fd:
            fd = os.open(leaf, _FILE_FLAGS, 0o600, dir_fd=dir_fd)
            try:
                self._copy(source, fd)
                os.fchmod(fd, member.mode & 0o755)
            finally:
                os.close(fd)

    def _copy(self, source: IO[bytes], fd: int) -> None:
        while chunk := source.read(_CHUNK_BYTES):
            if self._stop.is_set():
                raise _Stopped
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]

    def _finish(self) -> None:
        kind = self._kinds.get(SPEC_NAME)
        if kind is None:
            raise TemplateSpecError(Path(SPEC_NAME), "", "missing at the archive's root")
        if kind != "file":
            raise TemplateSpecError(Path(SPEC_NAME), "", "a directory, not a regular file")
        # Modes last: a directory without owner write could not have been filled.
        for path, mode in self._dir_modes.items():
            with _opened_dir(self._dest, path, create=False) as fd:
                os.fchmod(fd, mode)


@contextlib.contextmanager
def _opened_dir(root: Path, path: str, *, create: bool) -> Iterator[int]:
    """A directory fd for ``path`` under ``root``, walked part by part with O_NOFOLLOW."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in path.split("/") if path else ():
            made = False
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                    made = True
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
            if made:  # 0755 whatever the server's umask (077, issue 18): it goes to the guest
                os.fchmod(fd, 0o755)
        yield fd
    finally:
        os.close(fd)
