"""FakeNode's interactive stdin, PTY sizes and directory watches (issue 20).

A process started with ``open_stdin`` or ``pty`` takes ``write_stdin``: ``stdin`` holds
what each (sandbox id, process id) got, ``stdin_closed`` the ones closed (eof);
``pty_sizes`` the last size of each PTY process. Errors follow the node's contract:
NotFound (no process), Conflict (not running, stdin closed or never open, no PTY),
InvalidArgument (more than MAX_INPUT_BYTES, a size out of range).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from space.node.api import (
    Conflict,
    ExecRequest,
    InvalidArgument,
    NotFound,
    ProcessInfo,
    PtySize,
    WatchEvent,
)
from space.protocol import MAX_INPUT_BYTES, MAX_PTY_SIZE

__all__ = ["FakeStdio", "FakeWatchStream", "FakeWatches"]

_Key = tuple[str, str]


class FakeStdio:
    """The stdin half of FakeNode; ``_box`` (FakeNode's) checks the sandbox exists."""

    def __init__(self) -> None:
        self.stdin: dict[_Key, bytearray] = {}
        self.stdin_closed: set[_Key] = set()
        self.pty_sizes: dict[_Key, PtySize] = {}

    def _box(self, method: str, sandbox_id: str) -> Any:
        raise NotImplementedError  # FakeNode's

    def _stdio_started(self, sandbox_id: str, process_id: str, request: ExecRequest) -> None:
        """FakeNode.exec calls this for every process it starts."""
        if request.pty is not None:
            _check_size(request.pty)
            self.pty_sizes[(sandbox_id, process_id)] = request.pty
        if request.open_stdin or request.pty is not None:
            self.stdin[(sandbox_id, process_id)] = bytearray()

    def _process(self, method: str, sandbox_id: str, process_id: str) -> ProcessInfo:
        box = self._box(method, sandbox_id)
        if process_id not in box.processes:
            raise NotFound(f"no process {process_id}", sandbox_id=sandbox_id)
        info: ProcessInfo = box.processes[process_id][0]
        if not info.running:
            raise Conflict("the process has exited", sandbox_id=sandbox_id)
        return info

    async def write_stdin(
        self, sandbox_id: str, process_id: str, data: bytes, *, eof: bool = False
    ) -> int:
        self._process("write_stdin", sandbox_id, process_id)
        key = (sandbox_id, process_id)
        if key not in self.stdin:
            raise Conflict("the process was started without open_stdin or pty")
        if key in self.stdin_closed:
            raise Conflict("the process's stdin is closed", sandbox_id=sandbox_id)
        if len(data) > MAX_INPUT_BYTES:
            raise InvalidArgument(f"stdin of {len(data)} bytes exceeds {MAX_INPUT_BYTES}")
        self.stdin[key] += data
        if eof:
            self.stdin_closed.add(key)
        return len(data)

    async def resize_pty(self, sandbox_id: str, process_id: str, size: PtySize) -> None:
        self._process("resize_pty", sandbox_id, process_id)
        if (sandbox_id, process_id) not in self.pty_sizes:
            raise Conflict("the process has no pty", sandbox_id=sandbox_id)
        _check_size(size)
        self.pty_sizes[(sandbox_id, process_id)] = size


def _check_size(size: PtySize) -> None:
    if not (1 <= size.rows <= MAX_PTY_SIZE and 1 <= size.cols <= MAX_PTY_SIZE):
        raise InvalidArgument(f"pty rows and cols must be 1 to {MAX_PTY_SIZE}")


class FakeWatchStream:
    """A watch that yields its scripted events, then ends (the directory removed)."""

    def __init__(self, path: str, events: list[WatchEvent]) -> None:
        self.path = path
        self._events = events
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[WatchEvent]:
        for event in self._events:
            yield event

    async def aclose(self) -> None:
        self.closed = True


class FakeWatches:
    """FakeNode's watch_dir: ``watch_events[sandbox_id]`` is what a watch yields (set it
    in a test); ``watch_streams`` every watch opened. NotFound for a path that is no
    directory or file of the box, InvalidArgument for a file."""

    def __init__(self) -> None:
        self.watch_events: dict[str, list[WatchEvent]] = {}
        self.watch_streams: list[tuple[str, str, bool, FakeWatchStream]] = []

    def _box(self, method: str, sandbox_id: str) -> Any:
        raise NotImplementedError  # FakeNode's

    async def watch_dir(
        self, sandbox_id: str, path: str, *, recursive: bool = False, user: str = "user"
    ) -> FakeWatchStream:
        box = self._box("watch_dir", sandbox_id)
        if path in box.files:
            raise InvalidArgument(f"{path} is not a directory", sandbox_id=sandbox_id)
        if path not in box.dirs:
            raise NotFound(f"no directory {path}", sandbox_id=sandbox_id)
        stream = FakeWatchStream(path, list(self.watch_events.get(sandbox_id, [])))
        self.watch_streams.append((sandbox_id, path, recursive, stream))
        return stream
