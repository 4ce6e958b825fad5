"""Framing of the host <-> guest byte stream.

A frame on the wire is::

    length  u32 big-endian   number of bytes that follow the length field (>= 5)
    kind    u8               a FrameKind
    stream  u32 big-endian   0 for session-level frames, otherwise a stream id
    payload length - 5 bytes

The length is checked against ``MAX_FRAME_BYTES`` before a single byte of the body is
buffered, so a hostile peer cannot make the reader allocate more than one maximal frame.
This module is stdlib-only: the guest daemon imports it on the guest's own python3.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

__all__ = [
    "DATA_HEADER_BYTES",
    "HEADER_BYTES",
    "MAX_FRAME_BYTES",
    "MAX_PAYLOAD_BYTES",
    "Channel",
    "Frame",
    "FrameDecoder",
    "FrameKind",
    "ProtocolError",
    "encode_data_frame",
    "encode_frame",
    "pack_data_header",
]

_LENGTH = struct.Struct(">I")
_KIND_STREAM = struct.Struct(">BI")

#: Bytes before the payload: the length field, the kind and the stream id.
HEADER_BYTES = _LENGTH.size + _KIND_STREAM.size
#: Largest payload either side may send; data is chunked below this.
MAX_PAYLOAD_BYTES = 256 * 1024
#: Largest value the length field may carry.
MAX_FRAME_BYTES = MAX_PAYLOAD_BYTES + _KIND_STREAM.size
#: Largest stream id; ids are chosen by the host and never reused within a session.
MAX_STREAM_ID = 2**32 - 1


class ProtocolError(Exception):
    """The peer broke the protocol; the channel it came on must be closed."""


class FrameKind(enum.IntEnum):
    """What a frame means. Values are wire values and never change within a version."""

    HELLO = 1  # JSON, stream 0: host opens the session, the guest answers
    OPEN = 2  # JSON request {"op": ...}; host -> guest; starts a stream
    DATA = 3  # 1 byte Channel + bytes; counted against the receiver's credit
    EOF = 4  # 1 byte Channel: no more DATA on that channel
    RESULT = 5  # JSON; guest -> host; the last frame of a stream
    SIGNAL = 6  # JSON {"signal": n}; host -> guest: signal the stream's process
    CREDIT = 7  # u32: the sender may send that many more DATA payload bytes
    EVENT = 8  # JSON; guest -> host; a mid-stream event such as {"event": "started"}
    CANCEL = 9  # empty; host -> guest: the host abandons the stream
    PING = 10  # up to 64 bytes, stream 0; answered by PONG with the same bytes
    PONG = 11


class Channel(enum.IntEnum):
    """Sub-stream of DATA and EOF frames."""

    INPUT = 0  # host -> guest: stdin of an exec, body of a file write
    OUTPUT = 1  # guest -> host: stdout of an exec, body of a file read
    ERROR = 2  # guest -> host: stderr of an exec


@dataclass(frozen=True, slots=True)
class Frame:
    kind: FrameKind
    stream: int
    payload: bytes = b""


def encode_frame(kind: FrameKind, stream: int, payload: bytes = b"") -> bytes:
    """Return the wire bytes of one frame.

    Raises ProtocolError if the payload exceeds MAX_PAYLOAD_BYTES or the stream id is out
    of range: it is the caller's job to chunk data.
    """
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    if not 0 <= stream <= MAX_STREAM_ID:
        raise ProtocolError(f"stream id {stream} out of range")
    length = _KIND_STREAM.size + len(payload)
    return _LENGTH.pack(length) + _KIND_STREAM.pack(kind, stream) + payload


class FrameDecoder:
    """Incremental decoder: feed it bytes as they arrive, get whole frames back.

    It holds at most one partial frame, so its live bytes never exceed
    ``HEADER_BYTES + MAX_PAYLOAD_BYTES`` plus the bytes of the last ``feed`` call (its
    reused buffer at most twice that). Any
    violation raises ProtocolError and leaves the decoder unusable (``broken``).
    ``feed`` copies what it keeps, so callers may reuse the buffer they passed.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._max_frame_bytes = max_frame_bytes
        # Live bytes are buffer[start:end]. The buffer is reused, not resized per feed:
        # freeing and re-growing it costs page faults that dominate on an emulated CPU.
        self._buffer = bytearray()
        self._start = 0
        self._end = 0
        self.broken = False

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self.broken:
            raise ProtocolError("decoder already failed")
        size = len(data)
        if self._end + size > len(self._buffer):
            self._make_room(size)
        self._buffer[self._end : self._end + size] = data
        self._end += size
        frames: list[Frame] = []
        try:
            with memoryview(self._buffer) as view:
                self._start = self._cut(view, frames)
        except ProtocolError:
            self.broken = True
            self._buffer = bytearray()
            self._start = self._end = 0
            raise
        if self._start == self._end:
            self._start = self._end = 0
        return frames

    def _make_room(self, size: int) -> None:
        """Move the partial frame to the front, growing the buffer if that is not enough."""
        live = self._end - self._start
        if self._start:
            with memoryview(self._buffer) as view:
                view[:live] = view[self._start : self._end]
            self._start, self._end = 0, live
        if live + size > len(self._buffer):
            # Room for a few feeds, so the partial frame is moved only every few feeds.
            capacity = max(4 * (live + size), 2 * len(self._buffer))
            self._buffer.extend(bytes(capacity - len(self._buffer)))

    def _cut(self, view: memoryview, frames: list[Frame]) -> int:
        """Append the whole frames in view[start:end] to ``frames``; return where they end."""
        position = self._start
        end = self._end
        prefix = _LENGTH.size
        while end - position >= prefix:
            (length,) = _LENGTH.unpack_from(view, position)
            check_length(length, self._max_frame_bytes)
            if end - position - prefix < length:
                break
            body = position + prefix
            kind_value, stream = _KIND_STREAM.unpack_from(view, body)
            payload = bytes(view[body + _KIND_STREAM.size : body + length])
            frames.append(Frame(_kind(kind_value), stream, payload))
            position = body + length
        return position

    @property
    def buffered_bytes(self) -> int:
        return self._end - self._start


def _kind(value: int) -> FrameKind:
    try:
        return _KINDS[value]
    except KeyError:
        raise ProtocolError(f"unknown frame kind {value}") from None


_KINDS = {kind.value: kind for kind in FrameKind}


#: Bytes of a DATA frame before its data: the frame header and the channel byte.
DATA_HEADER_BYTES = HEADER_BYTES + 1
_DATA_HEADER = struct.Struct(">IBIB")


def pack_data_header(buffer: bytearray, stream: int, channel: Channel, size: int) -> None:
    """Write the header of a DATA frame carrying ``size`` bytes into ``buffer[:10]``.

    For senders that read data straight into ``buffer[DATA_HEADER_BYTES:]`` (no copy).
    Raises ProtocolError like ``encode_frame``.
    """
    if size + 1 > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"data chunk of {size} bytes is too large")
    if not 0 <= stream <= MAX_STREAM_ID:
        raise ProtocolError(f"stream id {stream} out of range")
    _DATA_HEADER.pack_into(buffer, 0, _KIND_STREAM.size + 1 + size, FrameKind.DATA, stream, channel)


def encode_data_frame(stream: int, channel: Channel, chunk: bytes | memoryview) -> bytes:
    """The wire bytes of one DATA frame (same as encode_frame of encode_data, one copy)."""
    header = bytearray(DATA_HEADER_BYTES)
    pack_data_header(header, stream, channel, len(chunk))
    return b"".join((header, chunk))


def check_length(length: int, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
    """Validate a frame's length field before anything is allocated for its body."""
    if length < _KIND_STREAM.size:
        raise ProtocolError(f"frame length {length} is shorter than a frame header")
    if length > max_frame_bytes:
        raise ProtocolError(f"frame length {length} exceeds the maximum {max_frame_bytes}")


def parse_body(body: bytes) -> Frame:
    """Turn the bytes after the length field into a Frame, validating the kind."""
    kind_value, stream = _KIND_STREAM.unpack_from(body)
    return Frame(_kind(kind_value), stream, body[_KIND_STREAM.size :])


def length_prefix_bytes() -> int:
    """Bytes to read first to learn a frame's length (for readers that read exactly)."""
    return _LENGTH.size


def unpack_length(prefix: bytes) -> int:
    (length,) = _LENGTH.unpack(prefix)
    return int(length)
