"""Copy sources on the host: resolved inside the spec's directory, listed and hashed.

Private to space.node.templates. A source, and every symlink met while listing it, must
resolve inside the spec's directory: a spec may not copy the host's files from elsewhere
into a template. Files are hashed in chunks of CHUNK_BYTES, never read whole. Errors are
TemplateSpecError through ``Where``, keyed by the copy step's ``src``.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from space.node.templates._fields import Where

__all__ = [
    "MAX_COPY_BYTES",
    "MAX_COPY_ENTRIES",
    "CopyEntry",
    "list_source",
    "path_order",
    "resolve_source",
]

CHUNK_BYTES = 1 << 20
#: Files and directories one copy step may hold.
MAX_COPY_ENTRIES = 65536
#: Bytes one copy step may hold: the largest disk a template may ask for (64 GiB).
MAX_COPY_BYTES = 65536 << 20
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class CopyEntry:
    """One file or directory a copy step puts into the template.

    ``sha256`` and ``size`` describe the file as it was hashed; a builder streaming
    ``source`` into the guest should hash again and refuse a file that changed since.
    """

    #: Where it goes, relative to the step's ``dst`` ("." is ``dst`` itself), with "/".
    path: str
    #: The resolved path on the host (no symlinks in it).
    source: Path
    kind: Literal["file", "dir"]
    #: Permission bits (``st_mode & 0o7777``).
    mode: int
    #: Bytes (0 for a directory).
    size: int = 0
    #: The content's sha256, lowercase hex (None for a directory).
    sha256: str | None = None

    def target(self, dst: str) -> str:
        """The entry's absolute path in the guest when copied to ``dst``."""
        if self.path == ".":
            return dst
        return f"{dst.rstrip('/')}/{self.path}"


def resolve_source(where: Where, spec_dir: Path, src: str, key: str) -> Path:
    """``src`` (relative to ``spec_dir``) resolved; it must exist inside ``spec_dir``."""
    if PurePosixPath(src).is_absolute():
        where.fail(key, f"{src!r} must be relative to the spec's directory")
    if ".." in PurePosixPath(src).parts:
        where.fail(key, f"{src!r} must not contain '..'")
    root = _resolve(where, spec_dir, key, "the spec's directory")
    resolved = _resolve(where, root / src, key, repr(src))
    if not resolved.is_relative_to(root):
        where.fail(key, f"{src!r} resolves to {resolved}, outside the spec's directory {root}")
    return resolved


def list_source(where: Where, spec_dir: Path, src: str, key: str) -> tuple[CopyEntry, ...]:
    """Every file and directory ``src`` copies, in ``path_order``, files hashed.

    Symlinks are followed while they stay inside ``spec_dir``; one that leaves it, a
    symlink cycle, anything but a regular file or directory, or more than the
    MAX_COPY_ENTRIES / MAX_COPY_BYTES limits is refused.
    """
    root = _resolve(where, spec_dir, key, "the spec's directory")
    source = resolve_source(where, spec_dir, src, key)
    try:
        entries = _Walk(where, root, key).run(source)
    except OSError as exc:
        where.fail(key, f"{src!r}: cannot be read: {exc}")
    return tuple(sorted(entries, key=path_order))


class _Walk:
    """A depth-first listing with an explicit stack (deep trees must not recurse)."""

    def __init__(self, where: Where, root: Path, key: str) -> None:
        self.where, self.root, self.key = where, root, key
        self.entries: list[CopyEntry] = []
        self.total_bytes = 0

    def run(self, source: Path) -> list[CopyEntry]:
        pending: list[tuple[str, Path, frozenset[Path]]] = [(".", source, frozenset())]
        while pending:
            if len(self.entries) >= MAX_COPY_ENTRIES:
                self.where.fail(self.key, f"more than {MAX_COPY_ENTRIES} files and directories")
            pending.extend(self._visit(*pending.pop()))
        return self.entries

    def _visit(
        self, path: str, real: Path, ancestors: frozenset[Path]
    ) -> list[tuple[str, Path, frozenset[Path]]]:
        """Add ``real`` (no symlinks in it) as ``path``; a directory's children to visit."""
        info = os.stat(real)
        if stat.S_ISREG(info.st_mode):
            self.total_bytes += info.st_size
            if self.total_bytes > MAX_COPY_BYTES:
                self.where.fail(self.key, f"more than {MAX_COPY_BYTES} bytes to copy")
            self.entries.append(_hash_file(self.where, self.key, path, real))
            return []
        if not stat.S_ISDIR(info.st_mode):
            self.where.fail(self.key, f"{path!r} is not a regular file or directory")
        if real in ancestors:
            self.where.fail(self.key, f"{path!r} is a symlink cycle back to {real}")
        mode = stat.S_IMODE(info.st_mode)
        self.entries.append(CopyEntry(path=path, source=real, kind="dir", mode=mode))
        inside = ancestors | {real}
        children = []
        for name in os.listdir(real):
            child = name if path == "." else f"{path}/{name}"
            children.append((child, self._follow(child, real / name), inside))
        return children

    def _follow(self, path: str, entry: Path) -> Path:
        """``entry`` itself, or where it points if it is a symlink inside the root."""
        if not entry.is_symlink():
            return entry
        target = _resolve(self.where, entry, self.key, repr(path))
        if not target.is_relative_to(self.root):
            self.where.fail(
                self.key, f"{path!r} is a symlink to {target}, outside the spec's directory"
            )
        return target


def path_order(entry: CopyEntry) -> tuple[str, ...]:
    """Sort key of entries: by path component, so every directory precedes its contents."""
    return () if entry.path == "." else tuple(entry.path.split("/"))


def _resolve(where: Where, path: Path, key: str, what: str) -> Path:
    try:
        return path.resolve(strict=True)
    except FileNotFoundError:
        where.fail(key, f"{what} does not exist")
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python 3.11)
        where.fail(key, f"{what} cannot be resolved: {exc}")


def _hash_file(where: Where, key: str, path: str, real: Path) -> CopyEntry:
    """Stream ``real`` through sha256, CHUNK_BYTES at a time."""
    # O_NONBLOCK: a file swapped for a FIFO after the stat must not hang the plan.
    fd = os.open(real, _OPEN_FLAGS)
    with os.fdopen(fd, "rb", buffering=0) as stream:
        info = os.fstat(stream.fileno())
        if not stat.S_ISREG(info.st_mode):
            where.fail(key, f"{path!r} is not a regular file")
        digest, size, buffer = hashlib.sha256(), 0, bytearray(CHUNK_BYTES)
        with memoryview(buffer) as view:
            while count := stream.readinto(view):
                digest.update(view[:count])
                size += count
    mode = stat.S_IMODE(info.st_mode)
    return CopyEntry(path, real, "file", mode, size=size, sha256=digest.hexdigest())
