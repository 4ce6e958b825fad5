"""Payloads carried in frames: JSON control messages, data chunks, credits.

Every decoder here validates size and shape and raises ProtocolError on anything else,
so callers never index into unchecked guest input.
"""

from __future__ import annotations

import enum
import json
import struct

from ._frames import MAX_PAYLOAD_BYTES, Channel, ProtocolError

__all__ = [
    "DATA_CHUNK_BYTES",
    "INITIAL_WINDOW_BYTES",
    "MAX_JSON_BYTES",
    "MAX_PING_BYTES",
    "MAX_STREAMS",
    "PROTOCOL_VERSION",
    "ErrorCode",
    "Op",
    "decode_credit",
    "decode_data",
    "decode_data_view",
    "decode_eof",
    "decode_json",
    "encode_credit",
    "encode_data",
    "encode_eof",
    "encode_json",
]

#: Version spoken by this module; the host's HELLO lists the versions it accepts.
PROTOCOL_VERSION = 1
#: Largest JSON control message (requests, results, events).
MAX_JSON_BYTES = 64 * 1024
#: Largest PING payload.
MAX_PING_BYTES = 64
#: Most streams open at once in one session, counted by the side that accepts them.
MAX_STREAMS = 1024
#: DATA bytes each side may send on a stream before it receives CREDIT.
INITIAL_WINDOW_BYTES = 1024 * 1024
#: Preferred size of one DATA payload (one byte of it is the channel): the largest, as
#: every frame costs the guest a wakeup and a few syscalls.
DATA_CHUNK_BYTES = MAX_PAYLOAD_BYTES

_CREDIT = struct.Struct(">I")


class Op(enum.StrEnum):
    """Requests the host may OPEN a stream with."""

    EXEC = "exec"
    PROCESS_LIST = "process.list"
    PROCESS_ATTACH = "process.attach"
    PROCESS_KILL = "process.kill"
    FILE_READ = "file.read"
    FILE_WRITE = "file.write"
    FILE_LIST = "file.list"
    FILE_STAT = "file.stat"
    FILE_MKDIR = "file.mkdir"
    FILE_REMOVE = "file.remove"
    FILE_RENAME = "file.rename"
    SYSTEM_INFO = "system.info"


class ErrorCode(enum.StrEnum):
    """Wire values of RESULT errors: {"ok": false, "error": {"code": ..., "message": ...}}."""

    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    INVALID_ARGUMENT = "invalid_argument"
    PERMISSION_DENIED = "permission_denied"
    IS_A_DIRECTORY = "is_a_directory"
    NOT_A_DIRECTORY = "not_a_directory"
    NOT_EMPTY = "not_empty"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    TIMEOUT = "timeout"
    UNSUPPORTED = "unsupported"
    INTERNAL = "internal"


def encode_json(message: dict[str, object]) -> bytes:
    data = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()
    if len(data) > MAX_JSON_BYTES:
        raise ProtocolError(f"JSON message of {len(data)} bytes exceeds {MAX_JSON_BYTES}")
    return data


def decode_json(payload: bytes) -> dict[str, object]:
    """Parse a JSON object; anything else (arrays, scalars, bad UTF-8) is an error."""
    if len(payload) > MAX_JSON_BYTES:
        raise ProtocolError(f"JSON message of {len(payload)} bytes exceeds {MAX_JSON_BYTES}")
    try:
        value = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"malformed JSON message: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError("JSON message is not an object")
    return value


def encode_data(channel: Channel, chunk: bytes) -> bytes:
    if len(chunk) + 1 > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"data chunk of {len(chunk)} bytes is too large")
    return bytes((channel,)) + chunk


def decode_data(payload: bytes) -> tuple[Channel, bytes]:
    return _decode_channel(payload[:1]), payload[1:]


def decode_data_view(payload: bytes) -> tuple[Channel, memoryview]:
    """Like decode_data, without copying the data (a view into ``payload``)."""
    return _decode_channel(payload[:1]), memoryview(payload)[1:]


def encode_eof(channel: Channel) -> bytes:
    return bytes((channel,))


def decode_eof(payload: bytes) -> Channel:
    if len(payload) != 1:
        raise ProtocolError(f"EOF payload must be 1 byte, got {len(payload)}")
    return _decode_channel(payload)


def encode_credit(increment: int) -> bytes:
    return _CREDIT.pack(increment)


def decode_credit(payload: bytes) -> int:
    if len(payload) != _CREDIT.size:
        raise ProtocolError(f"CREDIT payload must be {_CREDIT.size} bytes, got {len(payload)}")
    (increment,) = _CREDIT.unpack(payload)
    if increment == 0:
        raise ProtocolError("CREDIT of zero bytes")
    return int(increment)


def _decode_channel(raw: bytes) -> Channel:
    if len(raw) != 1:
        raise ProtocolError("missing channel byte")
    try:
        return Channel(raw[0])
    except ValueError:
        raise ProtocolError(f"unknown channel {raw[0]}") from None
