"""A template build context on its way from a client to the nodes: spooled, rewritten.

The upload (a tar, plain or gzip, with the spec as ``space.toml`` at its root) is never
held in memory: ``spool_upload`` writes it to an anonymous temporary file (at most
MAX_UPLOAD_BYTES), ``rewrite_context`` copies it entry by entry into a second one with
the spec rewritten (space.control.template_spec) and names normalised, and
``file_chunks`` streams that to each node. Re-writing the archive, rather than editing
it in place, means a node sees exactly the entries the control plane checked: one
``space.toml``, relative names without ``..``, only regular files and directories.
Anonymous temporary files disappear when closed, or when the process dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import os
import tarfile
import tempfile
import zlib
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import IO

from space.control.errors import ApiError
from space.control.template_spec import MAX_SPEC_BYTES

__all__ = [
    "MAX_ENTRIES",
    "MAX_UNPACKED_BYTES",
    "MAX_UPLOAD_BYTES",
    "SPEC_NAME",
    "file_chunks",
    "rewrite_context",
    "spool_upload",
]

#: Largest upload accepted (the archive as sent, compressed or not).
MAX_UPLOAD_BYTES = 1 << 30
#: Largest archive after decompression, and most entries: a gzip bomb stops here. The
#: entries are the node's limit for one copy step (docs/templates.md), plus the spec.
MAX_UNPACKED_BYTES = 4 << 30
MAX_ENTRIES = 65_536 + 1
SPEC_NAME = "space.toml"
_CHUNK_BYTES = 1 << 20
# Largest mtime a ustar header holds; others are clamped (mtimes are not hashed).
_MAX_MTIME = 8**11 - 1

Binary = IO[bytes]


def _invalid(problem: str) -> ApiError:
    return ApiError("invalid_argument", f"build context: {problem}")


async def spool_upload(chunks: AsyncIterable[bytes], limit_bytes: int = MAX_UPLOAD_BYTES) -> Binary:
    """Write ``chunks`` to an anonymous temporary file, rewound; the caller closes it.

    Raises ApiError(resource_exhausted) once more than ``limit_bytes`` arrive (the file
    is closed then); a cancellation also closes it.
    """
    with contextlib.ExitStack() as on_error:
        spool = on_error.enter_context(tempfile.TemporaryFile())
        size = 0
        async for chunk in chunks:
            size += len(chunk)
            if size > limit_bytes:
                raise ApiError(
                    "resource_exhausted",
                    f"build context larger than the {limit_bytes}-byte limit",
                    limit_bytes=limit_bytes,
                )
            await asyncio.to_thread(spool.write, chunk)
        spool.seek(0)
        on_error.pop_all()  # the caller's to close from here on
        return spool


def rewrite_context(raw: Binary, edit_spec: Callable[[bytes], bytes]) -> Binary:
    """A new archive (plain tar, temporary file, rewound) of ``raw``'s entries.

    ``edit_spec`` gets the bytes of ``space.toml`` (at most its limit + 1) and returns
    the new ones; its ApiError passes through. Blocking: run it in a thread. Raises
    ApiError(invalid_argument) for an archive that is not tar or gzip'd tar, has no or
    two ``space.toml``, an absolute name or ``..``, an entry other than a regular file
    or directory, or more than MAX_ENTRIES / MAX_UNPACKED_BYTES.
    """
    with contextlib.ExitStack() as on_error:
        out = on_error.enter_context(tempfile.TemporaryFile())
        try:
            with (
                tarfile.open(fileobj=raw, mode="r|*") as source,
                tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as target,
            ):
                _Copier(source, target, edit_spec).run()
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise _invalid(f"not a tar archive (plain or gzip): {exc}") from None
        out.seek(0)
        on_error.pop_all()  # the caller's to close from here on
        return out


@dataclass
class _Copier:
    source: tarfile.TarFile
    target: tarfile.TarFile
    edit_spec: Callable[[bytes], bytes]
    entries: int = 0
    unpacked_bytes: int = 0
    spec_seen: bool = False

    def run(self) -> None:
        for member in self.source:
            self.copy(member)
        if not self.spec_seen:
            raise _invalid(f"no {SPEC_NAME} at the archive's root")

    def copy(self, member: tarfile.TarInfo) -> None:
        name = _clean_name(member.name)
        if name is None:
            return  # the root directory itself
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise _invalid(f"more than {MAX_ENTRIES} entries")
        if member.isdir():
            self.target.addfile(_entry(name, member, tarfile.DIRTYPE, 0))
            return
        if not member.isfile():
            raise _invalid(f"{member.name!r}: only regular files and directories may be sent")
        self.unpacked_bytes += member.size
        if self.unpacked_bytes > MAX_UNPACKED_BYTES:
            raise _invalid(f"more than {MAX_UNPACKED_BYTES} bytes unpacked")
        data = self.source.extractfile(member)
        assert data is not None  # a regular file always has its data
        if name == SPEC_NAME:
            self.copy_spec(member, data)
        else:
            self.target.addfile(_entry(name, member, tarfile.REGTYPE, member.size), data)

    def copy_spec(self, member: tarfile.TarInfo, data: Binary) -> None:
        if self.spec_seen:
            raise _invalid(f"two entries are {SPEC_NAME}")
        self.spec_seen = True
        # Read whole, but bounded: the editor refuses more than MAX_SPEC_BYTES.
        spec = self.edit_spec(data.read(MAX_SPEC_BYTES + 1))
        entry = _entry(SPEC_NAME, member, tarfile.REGTYPE, len(spec))
        self.target.addfile(entry, io.BytesIO(spec))


def _clean_name(name: str) -> str | None:
    """``name`` without ``.`` parts or empty ones; None for the root; ApiError if unsafe."""
    if name.startswith("/") or "\0" in name or "\\" in name:
        raise _invalid(f"{name[:200]!r}: names must be relative, without NUL or backslash")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise _invalid(f"{name[:200]!r}: names must not contain '..'")
    return "/".join(parts) or None


def _entry(name: str, member: tarfile.TarInfo, kind: bytes, size: int) -> tarfile.TarInfo:
    entry = tarfile.TarInfo(name)
    entry.type = kind
    entry.size = size
    entry.mode = member.mode & 0o7777
    entry.mtime = min(max(int(member.mtime), 0), _MAX_MTIME)
    return entry


async def file_chunks(file: Binary, chunk_bytes: int = _CHUNK_BYTES) -> AsyncIterator[bytes]:
    """The bytes of ``file`` from its start, read in a thread; independent of other readers."""
    fd, offset = file.fileno(), 0
    while chunk := await asyncio.to_thread(os.pread, fd, chunk_bytes, offset):
        offset += len(chunk)
        yield chunk
