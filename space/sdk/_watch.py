"""``sandbox.files.watch_dir``: a directory's changes as they happen (issue 20).

The API streams them as NDJSON (docs/api.md, "Watching a directory"); an
AsyncDirWatcher iterates them as FilesystemEvents. Leaving it (``aclose``, the end of
``async with``, or an error) closes the stream, and the sandbox releases the watch.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from space.sdk._events import error_from_event, iter_events
from space.sdk._http import ApiClient, translate_errors
from space.sdk.errors import InternalError

__all__ = ["AsyncDirWatcher", "FilesystemEvent", "open_watch"]

#: Bound on each wait for the next change: only against a hung API (a directory may
#: stay quiet for hours; the node answers Timeout once the guest falls silent).
_READ_TIMEOUT_S = 24 * 3600.0
_TYPES = frozenset({"create", "write", "remove", "rename", "chmod", "dropped"})


@dataclass(frozen=True, slots=True)
class FilesystemEvent:
    """One change: ``type`` is create, write, remove, rename (the old name; the new one
    comes as create) or chmod; or ``dropped``, ``count`` changes lost because this
    watcher fell behind. ``path`` is absolute, ``name`` relative to the watched dir."""

    type: str
    path: str = ""
    name: str = ""
    is_dir: bool = False
    count: int = 0

    @classmethod
    def from_wire(cls, event: dict[str, Any]) -> FilesystemEvent:
        kind = event.get("type")
        if kind not in _TYPES:
            raise InternalError(f"unknown watch event type {kind!r}")
        return cls(
            type=str(kind),
            path=str(event.get("path", "")),
            name=str(event.get("name", "")),
            is_dir=bool(event.get("is_dir", False)),
            count=int(event.get("count", 0)),
        )


class AsyncDirWatcher:
    """A directory being watched (``path``, resolved in the sandbox). Iterate it for
    FilesystemEvents; the iteration ends if the directory itself is removed."""

    def __init__(self, stack: AsyncExitStack, events: Any, path: str, *, sandbox_id: str) -> None:
        self._stack = stack
        self._events = events
        self._sandbox_id = sandbox_id
        self.path = path

    def __aiter__(self) -> AsyncDirWatcher:
        return self

    async def __anext__(self) -> FilesystemEvent:
        try:
            with translate_errors(operation="files.watch_dir", sandbox_id=self._sandbox_id):
                event = await anext(self._events)
            if event.get("type") == "error":
                raise error_from_event(
                    event, sandbox_id=self._sandbox_id, operation="files.watch_dir"
                )
            return FilesystemEvent.from_wire(event)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Stop watching; idempotent."""
        await self._stack.aclose()

    async def __aenter__(self) -> AsyncDirWatcher:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()


async def open_watch(
    api: ApiClient, sandbox_id: str, path: str, *, recursive: bool
) -> AsyncDirWatcher:
    """Open the watch; returns once it is in place in the sandbox."""
    stack = AsyncExitStack()
    try:
        response = await stack.enter_async_context(
            api.stream(
                "GET",
                f"/v1/sandboxes/{sandbox_id}/files/watch",
                operation="files.watch_dir",
                sandbox_id=sandbox_id,
                params={"path": path, "recursive": "true" if recursive else "false"},
                read_timeout_s=_READ_TIMEOUT_S,
            )
        )
        events = iter_events(response)
        with translate_errors(operation="files.watch_dir", sandbox_id=sandbox_id):
            start = await anext(events)
        if start.get("type") == "error":
            raise error_from_event(start, sandbox_id=sandbox_id, operation="files.watch_dir")
        if start.get("type") != "start":
            raise InternalError("the watch stream did not start", sandbox_id=sandbox_id)
    except BaseException:
        await stack.aclose()
        raise
    return AsyncDirWatcher(stack, events, str(start.get("path", path)), sandbox_id=sandbox_id)
