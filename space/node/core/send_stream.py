"""The framing of a btrfs send stream, followed as its bytes pass (issue 19).

Both ends of a subvolume's trip read it: the root broker before ``btrfs receive``
(the node agent may be hostile), and the node agent after ``btrfs send`` and before a
receive, so that a stream that lost its framing is never stored, and a refusal says
on which side of the pipe it went wrong. Only the headers are parsed: the payloads
are skipped, so following a stream costs a few operations per command.
"""

from __future__ import annotations

import struct

from space.node.api import InvalidArgument

__all__ = ["SendStreamFraming"]

#: The send stream's header: the magic and a little-endian u32 version (1 or 2).
_MAGIC = b"btrfs-stream\0"
_HEADER = struct.Struct("<13sI")
_VERSIONS = (1, 2)
#: struct btrfs_cmd_header: le32 length of the payload, le16 command, le32 crc.
_COMMAND = struct.Struct("<IHI")
#: Commands of btrfs/send.h: 1 (SUBVOL) to 26 (ENABLE_VERITY, v3's last). A stream
#: opens one subvolume (or snapshot of a parent) and ends with END.
_CMD_SUBVOL, _CMD_SNAPSHOT, _CMD_END, _CMD_LAST = 1, 2, 21, 26
#: The longest command payload a stream holds (data writes are at most 64 KiB in v1;
#: v2's encoded writes up to 128 KiB plus their attributes).
_MAX_COMMAND_BYTES = 1 << 20


class SendStreamFraming:
    """Follows a send stream's framing: header, one subvolume, END last. ``feed`` and
    ``finish`` raise InvalidArgument at the first thing wrong, naming the byte offset,
    the command's number and the one before (where the framing was lost)."""

    def __init__(self) -> None:
        self.parsed = 0  # bytes taken so far
        self.ended = False
        self._pending = b""  # bytes of a header not complete yet
        self._skip = 0  # payload bytes of the current command still to pass
        self._header_done = False
        self._subvolumes = 0
        self._commands = 0
        self._last = (0, 0)  # the previous command: (number, payload bytes)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view:
            if self._skip:
                step = min(self._skip, len(view))
                self._skip -= step
                self.parsed += step
                view = view[step:]
                continue
            if self.ended:
                raise InvalidArgument(
                    f"bytes after the stream's end command, at byte {self.parsed}"
                )
            size = (_HEADER if not self._header_done else _COMMAND).size
            want = size - len(self._pending)
            self._pending += bytes(view[:want])
            self.parsed += min(want, len(view))
            view = view[want:]
            if len(self._pending) == size:
                self._take_header()

    def finish(self) -> None:
        """The stream stopped: InvalidArgument unless it stopped right after its END."""
        if not self.ended or self._skip or self._pending:
            raise InvalidArgument(f"the stream stops after {self.parsed} bytes, before its end")

    def _take_header(self) -> None:
        raw, self._pending = self._pending, b""
        if not self._header_done:
            magic, version = _HEADER.unpack(raw)
            if magic != _MAGIC or version not in _VERSIONS:
                raise InvalidArgument("not a btrfs send stream")
            self._header_done = True
            return
        length, command, _crc = _COMMAND.unpack(raw)
        if length > _MAX_COMMAND_BYTES or not _CMD_SUBVOL <= command <= _CMD_LAST:
            before, size = self._last
            raise InvalidArgument(
                f"a stream command {command} of {length} bytes (header {raw.hex()} at byte"
                f" {self.parsed - len(raw)}, command {self._commands + 1}; the one before:"
                f" {before}, of {size} bytes)"
            )
        self._commands += 1
        self._last = (command, length)
        if command in (_CMD_SUBVOL, _CMD_SNAPSHOT):
            self._subvolumes += 1
        if self._subvolumes != 1:
            raise InvalidArgument("a stream holds exactly one subvolume, opened first")
        self.ended = command == _CMD_END
        self._skip = length
