"""file.watch: a directory's changes as a stream of NDJSON lines (issue 20).

inotify through ctypes (the guest is stdlib-only). A watch is one stream: EVENT
``{"event": "watching", "path"}`` once the watches are in place, then DATA OUTPUT
carrying one JSON object a line, ``{"type", "path", "name", "is_dir"}`` with ``type``
one of create, write, remove, rename, chmod (``name`` relative to the watched
directory), or ``{"type": "dropped", "count": n}``. It ends when the host CANCELs it
(the watches are released then) or the directory itself goes (RESULT ``{"ok": true,
"reason": "removed"}``).

Bounded: at most ``MAX_WATCH_STREAMS`` watch streams at once and ``MAX_WATCHED_DIRS``
directories watched in all (a recursive watch of a larger tree is
``resource_exhausted``; directories made later beyond the bound go unwatched and count
as dropped). Lines wait in a queue of ``MAX_PENDING_EVENTS``: a line equal to one still
waiting is coalesced into it, and past the bound lines are dropped and counted, the
count sent as a ``dropped`` line before the next ones. A slow host thus costs the guest
a bounded queue, never growing memory; the DATA itself waits for the host's credit.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import json
import os
import stat
import struct
from collections import OrderedDict
from dataclasses import dataclass, field

from space.protocol import Channel, ErrorCode

from ._errors import OpError, from_oserror
from ._request import Accounts, Fields
from ._session import Stream

__all__ = ["MAX_PENDING_EVENTS", "MAX_WATCHED_DIRS", "MAX_WATCH_STREAMS", "Watches", "op_watch"]

MAX_WATCH_STREAMS = 64
MAX_WATCHED_DIRS = 8192
MAX_PENDING_EVENTS = 4096
#: Bytes of lines per DATA frame (well under a frame; fewer frames when events pour in).
_BATCH_BYTES = 32 * 1024

_IN_MODIFY, _IN_ATTRIB, _IN_MOVED_FROM, _IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
_IN_CREATE, _IN_DELETE, _IN_DELETE_SELF, _IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
_IN_Q_OVERFLOW, _IN_IGNORED, _IN_ISDIR = 0x4000, 0x8000, 0x40000000
_IN_ONLYDIR, _IN_DONT_FOLLOW, _IN_EXCL_UNLINK = 0x01000000, 0x02000000, 0x04000000
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_MASK = (
    _IN_MODIFY | _IN_ATTRIB | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
    | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_ONLYDIR | _IN_DONT_FOLLOW | _IN_EXCL_UNLINK
)  # fmt: skip
#: inotify's mask bits → our event types, in the order a mask is read.
_TYPES = (
    (_IN_CREATE, "create"),
    (_IN_MOVED_TO, "create"),
    (_IN_MODIFY, "write"),
    (_IN_DELETE, "remove"),
    (_IN_MOVED_FROM, "rename"),
    (_IN_ATTRIB, "chmod"),
)
_HEADER = struct.Struct("iIII")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, what: str) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
    return result


class Watches:
    """spaced's budget of watch streams and watched directories (all sessions)."""

    def __init__(
        self, max_streams: int = MAX_WATCH_STREAMS, max_dirs: int = MAX_WATCHED_DIRS
    ) -> None:
        self.max_streams = max_streams
        self.max_dirs = max_dirs
        self.streams = 0
        self.dirs = 0


@dataclass
class _Watcher:
    root: str
    recursive: bool
    budget: Watches
    fd: int = -1
    dirs: dict[int, str] = field(default_factory=dict)
    pending: OrderedDict[str, None] = field(default_factory=OrderedDict)
    dropped: int = 0
    gone: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def open(self) -> None:
        libc = _libc()
        self._add = libc.inotify_add_watch
        self._rm = libc.inotify_rm_watch
        self.fd = _check(libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC), "inotify_init1")
        self.watch(self.root, strict=True)

    def watch(self, path: str, *, strict: bool) -> None:
        """Watch ``path`` (and its subdirectories, if recursive). ``strict``: at the
        start, where a bound is an error; later a directory past it goes unwatched."""
        todo = [path]
        while todo:
            directory = todo.pop()
            if self.budget.dirs >= self.budget.max_dirs:
                if strict:
                    raise OpError(
                        ErrorCode.RESOURCE_EXHAUSTED,
                        f"more than {self.budget.max_dirs} directories watched",
                    )
                self.dropped += 1
                continue
            try:
                wd = _check(
                    self._add(self.fd, os.fsencode(directory), _MASK), f"watching {directory}"
                )
            except OSError:
                if strict and directory == path:
                    raise
                continue  # gone meanwhile, or unreadable: not ours to watch
            if wd not in self.dirs:
                self.budget.dirs += 1
            self.dirs[wd] = directory
            if self.recursive:
                todo.extend(_subdirs(directory))

    def close(self) -> None:
        self.budget.dirs -= len(self.dirs)
        self.dirs.clear()
        if self.fd >= 0:
            os.close(self.fd)  # releases every watch of it
            self.fd = -1

    def read(self) -> None:
        """Take what inotify has (the loop called us: readable) into ``pending``."""
        while True:
            try:
                data = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                break
            if not data:
                break
            self._parse(data)
        self.changed.set()

    def _parse(self, data: bytes) -> None:
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _cookie, size = _HEADER.unpack_from(data, offset)
            raw = data[offset + _HEADER.size : offset + _HEADER.size + size]
            offset += _HEADER.size + size
            name = os.fsdecode(raw.rstrip(b"\0"))
            self._event(wd, mask, name)

    def _event(self, wd: int, mask: int, name: str) -> None:
        if mask & _IN_Q_OVERFLOW:
            self.dropped += 1
            return
        directory = self.dirs.get(wd)
        if directory is None:
            return
        if mask & _IN_IGNORED:  # its watch is gone (the directory removed)
            del self.dirs[wd]
            self.budget.dirs -= 1
        if mask & (_IN_DELETE_SELF | _IN_MOVE_SELF) and directory == self.root:
            self.gone = True
            return
        if not name:
            return  # the directory's own events: its parent reports them
        path = os.path.join(directory, name)
        is_dir = bool(mask & _IN_ISDIR)
        for bit, kind in _TYPES:
            if mask & bit:
                self._queue(kind, path, is_dir)
        if is_dir and self.recursive and mask & (_IN_CREATE | _IN_MOVED_TO):
            self.watch(path, strict=False)
            # Made before its watch was in place: report what it already holds.
            for child, child_is_dir in _entries(path):
                self._queue("create", child, child_is_dir)

    def _queue(self, kind: str, path: str, is_dir: bool) -> None:
        line = json.dumps(
            {
                "type": kind,
                "path": path,
                "name": os.path.relpath(path, self.root),
                "is_dir": is_dir,
            }
        )  # ASCII: a name that is no UTF-8 (surrogate escapes) travels as \udcXX
        if line in self.pending:
            return  # coalesced with the same event still waiting
        if len(self.pending) >= MAX_PENDING_EVENTS:
            self.dropped += 1
            return
        self.pending[line] = None

    def take(self) -> bytes:
        """Pending lines, up to about _BATCH_BYTES, the dropped count first."""
        lines: list[str] = []
        size = 0
        if self.dropped:
            lines.append(json.dumps({"type": "dropped", "count": self.dropped}))
            self.dropped = 0
        while self.pending and size < _BATCH_BYTES:
            line, _ = self.pending.popitem(last=False)
            lines.append(line)
            size += len(line) + 1
        return "".join(line + "\n" for line in lines).encode()


def _subdirs(path: str) -> list[str]:
    with contextlib.suppress(OSError), os.scandir(path) as scan:
        return [e.path for e in scan if e.is_dir(follow_symlinks=False)]
    return []


def _entries(path: str) -> list[tuple[str, bool]]:
    with contextlib.suppress(OSError), os.scandir(path) as scan:
        return [(e.path, e.is_dir(follow_symlinks=False)) for e in scan]
    return []


async def op_watch(
    stream: Stream, fields: Fields, accounts: Accounts, budget: Watches
) -> dict[str, object]:
    account = accounts.get(fields)
    root = account.resolve(fields.string("path", max_chars=4096))
    recursive = fields.boolean("recursive", False)
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            raise OpError(ErrorCode.NOT_A_DIRECTORY, f"{root} is not a directory")
    except OSError as exc:
        raise from_oserror(exc) from None
    if budget.streams >= budget.max_streams:
        raise OpError(ErrorCode.RESOURCE_EXHAUSTED, f"{budget.max_streams} watches open")
    budget.streams += 1
    watcher = _Watcher(root, recursive, budget)
    loop = asyncio.get_running_loop()
    try:
        watcher.open()
        loop.add_reader(watcher.fd, watcher.read)
        await stream.send_event({"event": "watching", "path": root})
        return await _pump(stream, watcher)
    finally:
        if watcher.fd >= 0:
            loop.remove_reader(watcher.fd)
        watcher.close()
        budget.streams -= 1


async def _pump(stream: Stream, watcher: _Watcher) -> dict[str, object]:
    while True:
        await watcher.changed.wait()
        watcher.changed.clear()
        while watcher.pending or watcher.dropped:
            # Waits for the host's credit: meanwhile inotify's lines queue (bounded).
            await stream.send_data(Channel.OUTPUT, watcher.take())
        if watcher.gone:
            await stream.send_eof(Channel.OUTPUT)
            return {"ok": True, "reason": "removed"}
