"""The host's half of file.watch (issue 20): NDJSON lines from the guest, parsed with
the suspicion everything from the guest gets.

Lines arrive as DATA on OUTPUT, split anywhere; a partial line is held only up to
MAX_WATCH_LINE_BYTES, and each line must be one JSON object of the documented shape
(docs/protocol.md, "file.watch"). Anything else is a protocol violation: ``violation``
(the channel's ``_fail``) closes the channel, and the iteration raises Unavailable.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import cast

from space.node.api import Unavailable, WatchEvent
from space.node.channel._streams import Data

__all__ = ["MAX_WATCH_LINE_BYTES", "ChannelWatchStream", "parse_watch_line"]

#: Longest line: a path of 4,096 characters JSON-escaped twice (path and name) fits.
MAX_WATCH_LINE_BYTES = 64 * 1024
_TYPES = frozenset({"create", "write", "remove", "rename", "chmod"})
_MAX_PATH_CHARS = 4096


def parse_watch_line(line: bytes) -> WatchEvent:
    """One event line; raises ValueError when it is not of the documented shape."""
    value = json.loads(line)
    if not isinstance(value, dict):
        raise ValueError("a watch line is not an object")
    kind = value.get("type")
    if kind == "dropped":
        count = value.get("count")
        if isinstance(count, bool) or not isinstance(count, int) or not 0 < count < 2**53:
            raise ValueError("a dropped line without a positive count")
        return WatchEvent("dropped", count=count)
    if kind not in _TYPES:
        raise ValueError(f"unknown watch event type {str(kind)[:32]!r}")
    path, name, is_dir = value.get("path"), value.get("name"), value.get("is_dir")
    for text in (path, name):
        if not isinstance(text, str) or not 0 < len(text) <= _MAX_PATH_CHARS:
            raise ValueError("a watch event's path and name must be short strings")
    if not isinstance(is_dir, bool):
        raise ValueError("a watch event's is_dir must be a boolean")
    return WatchEvent(cast(str, kind), cast(str, path), cast(str, name), is_dir)  # type: ignore[arg-type]


class ChannelWatchStream:
    """WatchStream over a channel stream (see space.node.api.interface.WatchStream)."""

    def __init__(
        self,
        path: str,
        next_item: Callable[[], Awaitable[object]],
        abandon: Callable[[], Awaitable[None]],
        violation: Callable[[str], None],
        sandbox_id: str,
    ) -> None:
        self.path = path
        self._next_item = next_item
        self._abandon = abandon
        self._violation = violation
        self._sandbox_id = sandbox_id
        self._finished = False
        self._partial = b""
        #: Lines parsed but not yet yielded: kept here, not in a generator, so a new
        #: iteration of the stream picks up where the last one stopped.
        self._ready: deque[WatchEvent] = deque()

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[WatchEvent]:
        while self._ready or not self._finished:
            if self._ready:
                yield self._ready.popleft()
                continue
            item = await self._next_item()
            if not isinstance(item, Data):
                self._finished = True  # the RESULT: the directory is gone
                return
            for line in self._lines(item.data):
                try:
                    self._ready.append(parse_watch_line(line))
                except ValueError as exc:
                    raise self._broken(f"malformed watch line: {exc}") from None

    def _lines(self, data: bytes) -> list[bytes]:
        *lines, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > MAX_WATCH_LINE_BYTES:
            raise self._broken(f"a watch line longer than {MAX_WATCH_LINE_BYTES} bytes")
        return lines

    def _broken(self, reason: str) -> Unavailable:
        self._finished = True
        self._violation(f"protocol violation: {reason}")
        return Unavailable(f"guest channel broken: {reason}", sandbox_id=self._sandbox_id)

    async def aclose(self) -> None:
        """Stop watching: the guest releases the watch."""
        if not self._finished:
            self._finished = True
            await self._abandon()
