"""envd's ``filesystem.Filesystem`` service, translated to our guest's file operations.

- Stat: file.stat. ListDir: file.list, level by level down to ``depth`` (at most
  MAX_LIST_DEPTH levels and MAX_LIST_ENTRIES entries). MakeDir: already_exists for a
  path that exists (the SDK answers False), else file.mkdir. Move: file.rename.
  Remove: file.remove, recursive (as envd's).
- WatchDir: file.watch, streamed. CreateWatcher / GetWatcherEvents / RemoveWatcher: the
  same watch held by this control-plane replica (Watchers): at most
  MAX_WATCHERS_PER_SANDBOX per sandbox, MAX_BUFFERED_EVENTS events kept (older ones
  dropped), and removed after WATCHER_IDLE_S without a poll. A watcher lives in the
  replica that created it: behind a load balancer, polls must reach that replica.

EntryInfo is what our stat gives: name, type, path, size, mode (permission bits),
permissions (``-rw-r--r--``), owner (also given as group: our stat has no group) and
modifiedTime; no symlinkTarget (our stat does not read links).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import secrets
import stat as stat_module
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from space.control.e2b.connect import Code, ConnectError, Fields
from space.node.api import FileStat, NodeService, WatchEvent, WatchStream
from space.node.api.errors import NotFound

__all__ = [
    "MAX_BUFFERED_EVENTS",
    "MAX_LIST_DEPTH",
    "MAX_LIST_ENTRIES",
    "MAX_WATCHERS_PER_SANDBOX",
    "WATCHER_IDLE_S",
    "FilesystemService",
    "Watchers",
    "entry_info",
]

MAX_LIST_DEPTH = 16
MAX_LIST_ENTRIES = 10_000
MAX_WATCHERS_PER_SANDBOX = 16
MAX_BUFFERED_EVENTS = 1024
WATCHER_IDLE_S = 120.0

_FILE_TYPES = {
    "file": "FILE_TYPE_FILE",
    "dir": "FILE_TYPE_DIRECTORY",
    "symlink": "FILE_TYPE_SYMLINK",
}
_EVENT_TYPES = {
    "create": "EVENT_TYPE_CREATE",
    "write": "EVENT_TYPE_WRITE",
    "remove": "EVENT_TYPE_REMOVE",
    "rename": "EVENT_TYPE_RENAME",
    "chmod": "EVENT_TYPE_CHMOD",
}
_TYPE_LETTERS = {"dir": "d", "symlink": "L", "other": "?"}


def _permissions(kind: str, mode: int) -> str:
    """Go's FileMode.String(): ``drwxr-xr-x``, ``-rw-r--r--``."""
    text = stat_module.filemode(mode & 0o777)[1:]
    return _TYPE_LETTERS.get(kind, "-") + text


def entry_info(stat: FileStat) -> dict[str, Any]:
    modified = datetime.datetime.fromtimestamp(stat.mtime, datetime.UTC)
    return {
        "name": stat.name,
        "type": _FILE_TYPES.get(stat.type, "FILE_TYPE_UNSPECIFIED"),
        "path": stat.path,
        "size": str(stat.size),
        "mode": stat.mode & 0o7777,
        "permissions": _permissions(stat.type, stat.mode),
        "owner": stat.owner,
        "group": stat.owner,
        "modifiedTime": modified.isoformat().replace("+00:00", "Z"),
        "isSymlink": stat.type == "symlink",
    }


def _fs_event(event: WatchEvent) -> dict[str, Any]:
    return {"name": event.name, "type": _EVENT_TYPES[event.type]}


#: A streamed watch's idle message.
KEEPALIVE: dict[str, Any] = {"keepalive": {}}


@dataclass
class _Watcher:
    sandbox_id: str
    stream: WatchStream
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_BUFFERED_EVENTS))
    polled_at: float = field(default_factory=time.monotonic)
    task: asyncio.Task[None] | None = None
    #: Set when the watch ended (its directory removed, or the channel failed).
    ended: ConnectError | None = None


class Watchers:
    """The non-streaming watchers of one control-plane replica, bounded per sandbox and
    expired when idle. ``spawn`` runs a watcher's pump (the app's tasks, cancelled at
    shutdown)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._watchers: dict[str, _Watcher] = {}
        self._clock = clock
        #: Expires idle watchers while there are any (also when nobody calls in).
        self._reaper: asyncio.Task[None] | None = None

    def count(self, sandbox_id: str) -> int:
        return sum(1 for w in self._watchers.values() if w.sandbox_id == sandbox_id)

    async def create(
        self,
        sandbox_id: str,
        open_watch: Callable[[], Any],
        spawn: Callable[[Any], asyncio.Task[None]],
    ) -> str:
        await self.expire()
        if self.count(sandbox_id) >= MAX_WATCHERS_PER_SANDBOX:
            raise ConnectError(
                Code.RESOURCE_EXHAUSTED,
                f"{MAX_WATCHERS_PER_SANDBOX} watchers in this sandbox (the limit); "
                "remove one first",
            )
        stream: WatchStream = await open_watch()
        watcher_id = "w" + secrets.token_hex(12)
        watcher = _Watcher(sandbox_id, stream, polled_at=self._clock())
        self._watchers[watcher_id] = watcher
        watcher.task = spawn(self._pump(watcher))
        if self._reaper is None or self._reaper.done():
            self._reaper = spawn(self._reap())
        return watcher_id

    async def _reap(self) -> None:
        while self._watchers:
            await asyncio.sleep(WATCHER_IDLE_S / 4)
            await self.expire()

    async def _pump(self, watcher: _Watcher) -> None:
        try:
            async for event in watcher.stream:
                if event.type != "dropped":
                    watcher.events.append(_fs_event(event))
            watcher.ended = ConnectError(Code.NOT_FOUND, "the watched directory is gone")
        except Exception as exc:  # the watch ended; the next poll says so
            watcher.ended = ConnectError(Code.UNAVAILABLE, f"the watch ended: {exc}")

    def _get(self, sandbox_id: str, watcher_id: str) -> _Watcher:
        watcher = self._watchers.get(watcher_id)
        if watcher is None or watcher.sandbox_id != sandbox_id:
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id[:64]!r} not found")
        return watcher

    async def events(self, sandbox_id: str, watcher_id: str) -> list[dict[str, Any]]:
        """The events since the last poll (at most MAX_BUFFERED_EVENTS, the latest)."""
        await self.expire()
        watcher = self._get(sandbox_id, watcher_id)
        watcher.polled_at = self._clock()
        taken = list(watcher.events)
        watcher.events.clear()
        if not taken and watcher.ended is not None:
            await self.remove(sandbox_id, watcher_id)
            raise watcher.ended
        return taken

    async def remove(self, sandbox_id: str, watcher_id: str) -> None:
        watcher = self._get(sandbox_id, watcher_id)
        del self._watchers[watcher_id]
        if watcher.task is not None:
            watcher.task.cancel()
            with contextlib.suppress(BaseException):
                await watcher.task
        # Here, not in the pump: a pump cancelled before it ran has no finally to run.
        with contextlib.suppress(Exception):
            await watcher.stream.aclose()

    async def expire(self) -> None:
        """Remove the watchers nobody polled for WATCHER_IDLE_S."""
        now = self._clock()
        for watcher_id, watcher in list(self._watchers.items()):
            if now - watcher.polled_at > WATCHER_IDLE_S:
                await self.remove(watcher.sandbox_id, watcher_id)


@dataclass
class FilesystemService:
    node: NodeService
    sandbox_id: str
    user: str
    watchers: Watchers
    spawn: Callable[[Any], asyncio.Task[None]]

    def _path(self, fields: Fields, name: str = "path") -> str:
        path = fields.string(name)
        if not path:
            raise ConnectError(Code.INVALID_ARGUMENT, f"{name} must not be empty")
        return path

    async def stat(self, fields: Fields) -> dict[str, Any]:
        stat = await self.node.stat(self.sandbox_id, self._path(fields), self.user)
        return {"entry": entry_info(stat)}

    async def list_dir(self, fields: Fields) -> dict[str, Any]:
        depth = fields.integer("depth", high=MAX_LIST_DEPTH) or 1
        root = self._path(fields)
        entries: list[dict[str, Any]] = []
        level = [root]
        for _ in range(depth):
            below: list[str] = []
            for directory in level:
                for stat in await self.node.list_dir(self.sandbox_id, directory, self.user):
                    if len(entries) >= MAX_LIST_ENTRIES:
                        raise ConnectError(
                            Code.RESOURCE_EXHAUSTED,
                            f"more than {MAX_LIST_ENTRIES} entries; list with a smaller depth",
                        )
                    entries.append(entry_info(stat))
                    if stat.type == "dir":
                        below.append(stat.path)
            level = below
        return {"entries": entries}

    async def make_dir(self, fields: Fields) -> dict[str, Any]:
        path = self._path(fields)
        with contextlib.suppress(NotFound):
            await self.node.stat(self.sandbox_id, path, self.user)
            raise ConnectError(Code.ALREADY_EXISTS, f"{path} already exists")
        stat = await self.node.make_dir(self.sandbox_id, path, self.user)
        return {"entry": entry_info(stat)}

    async def move(self, fields: Fields) -> dict[str, Any]:
        source, destination = self._path(fields, "source"), self._path(fields, "destination")
        stat = await self.node.rename(self.sandbox_id, source, destination, self.user)
        return {"entry": entry_info(stat)}

    async def remove(self, fields: Fields) -> dict[str, Any]:
        await self.node.remove(self.sandbox_id, self._path(fields), recursive=True)
        return {}

    async def _watch(self, fields: Fields) -> WatchStream:
        return await self.node.watch_dir(
            self.sandbox_id,
            self._path(fields),
            recursive=fields.boolean("recursive"),
            user=self.user,
        )

    async def watch_dir(self, fields: Fields) -> AsyncIterator[dict[str, Any]]:
        stream = await self._watch(fields)
        try:
            yield {"start": {}}
            async for event in stream:
                if event.type != "dropped":
                    yield {"filesystem": _fs_event(event)}
        finally:
            await stream.aclose()

    async def create_watcher(self, fields: Fields) -> dict[str, Any]:
        watcher_id = await self.watchers.create(
            self.sandbox_id, lambda: self._watch(fields), self.spawn
        )
        return {"watcherId": watcher_id}

    async def get_watcher_events(self, fields: Fields) -> dict[str, Any]:
        watcher_id = fields.string("watcher_id", max_chars=64)
        return {"events": await self.watchers.events(self.sandbox_id, watcher_id)}

    async def remove_watcher(self, fields: Fields) -> dict[str, Any]:
        await self.watchers.remove(self.sandbox_id, fields.string("watcher_id", max_chars=64))
        return {}
