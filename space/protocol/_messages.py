"""Payloads carried in frames: JSON control messages, data chunks, credits.

Every decoder here validates size and shape and raises ProtocolError on anything else,
so callers never index into unchecked guest input.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from ._frames import MAX_PAYLOAD_BYTES, Channel, ProtocolError

__all__ = [
    "DATA_CHUNK_BYTES",
    "IDENTITY_FIELDS",
    "INITIAL_WINDOW_BYTES",
    "MAX_ENTROPY_BYTES",
    "MAX_HOSTNAME_CHARS",
    "MAX_INPUT_BYTES",
    "MAX_JSON_BYTES",
    "MAX_PID",
    "MAX_PING_BYTES",
    "MAX_PTY_SIZE",
    "MAX_STREAMS",
    "MAX_TAG_CHARS",
    "MAX_TIME_NS",
    "MIN_ENTROPY_BYTES",
    "MIN_TIME_NS",
    "PROTOCOL_VERSION",
    "TAG_PATTERN",
    "ErrorCode",
    "Identity",
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
#: Most stdin bytes one process.input carries: the initial window, so a write never
#: waits for CREDIT; larger input is sent as several calls (issue 20).
MAX_INPUT_BYTES = INITIAL_WINDOW_BYTES
#: Largest rows and columns of a pseudo-terminal (both at least 1): far more than any
#: screen, and small enough for the kernel's u16 winsize.
MAX_PTY_SIZE = 1000
#: A process tag: 1 to 64 of these characters (a label a client finds a process by).
MAX_TAG_CHARS = 64
TAG_PATTERN = r"[A-Za-z0-9_.:-]{1,64}"
#: Largest pid a process.attach may name: Linux's PID_MAX_LIMIT on 64-bit.
MAX_PID = 4 * 1024 * 1024

_CREDIT = struct.Struct(">I")
_T = TypeVar("_T")


class Op(enum.StrEnum):
    """Requests the host may OPEN a stream with."""

    EXEC = "exec"
    PROCESS_LIST = "process.list"
    PROCESS_ATTACH = "process.attach"
    PROCESS_KILL = "process.kill"
    #: Stdin for a process started with ``open_stdin`` or ``pty`` (issue 20).
    PROCESS_INPUT = "process.input"
    PROCESS_RESIZE = "process.resize"
    FILE_READ = "file.read"
    FILE_WRITE = "file.write"
    FILE_LIST = "file.list"
    FILE_STAT = "file.stat"
    FILE_MKDIR = "file.mkdir"
    FILE_REMOVE = "file.remove"
    FILE_RENAME = "file.rename"
    #: A directory's changes, streamed until cancelled (issue 20).
    FILE_WATCH = "file.watch"
    SYSTEM_INFO = "system.info"
    SYSTEM_IDENTITY = "system.identity"
    SYSTEM_METRICS = "system.metrics"
    #: A TCP connection to a server listening in the guest, relayed both ways (issue
    #: 20, port exposure): INPUT DATA to the server, its bytes as OUTPUT DATA.
    PORT_CONNECT = "port.connect"


class ErrorCode(enum.StrEnum):
    """Wire values of RESULT errors: {"ok": false, "error": {"code": ..., "message": ...}}."""

    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    INVALID_ARGUMENT = "invalid_argument"
    PERMISSION_DENIED = "permission_denied"
    IS_A_DIRECTORY = "is_a_directory"
    NOT_A_DIRECTORY = "not_a_directory"
    NOT_EMPTY = "not_empty"
    #: The target is in the wrong state (stdin of a finished process, already closed).
    CONFLICT = "conflict"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    TIMEOUT = "timeout"
    UNSUPPORTED = "unsupported"
    #: port.connect found nothing listening on the port (127.0.0.1 nor ::1).
    CONNECTION_REFUSED = "connection_refused"
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


# -- system.identity --

#: Fields of a system.identity request, in the order spaced applies them: the clock
#: first, so that everything after it (file mtimes, log lines) carries the right time.
IDENTITY_FIELDS = ("time_ns", "entropy", "hostname", "machine_id")
#: Longest hostname: the kernel's limit (HOST_NAME_MAX, 64; sethostname fails beyond
#: it) is tighter than DNS's 253 characters.
MAX_HOSTNAME_CHARS = 64
#: Random bytes per request: at least 256 bits, enough to seed the kernel's CRNG.
MIN_ENTROPY_BYTES = 32
MAX_ENTROPY_BYTES = 512
#: Accepted wall clock, in ns since the epoch: 2000-01-01T00:00:00Z (inclusive) to
#: 2201-01-01T00:00:00Z (exclusive), i.e. the years 2000 to 2200.
MIN_TIME_NS = 946_684_800 * 10**9
MAX_TIME_NS = 7_289_654_400 * 10**9 - 1

# RFC 1123 labels, lowercase only: no leading or trailing hyphen.
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_MACHINE_ID = re.compile(r"[0-9a-f]{32}")
_MAX_ENTROPY_BASE64_CHARS = 4 * -(-MAX_ENTROPY_BYTES // 3)


@dataclass(frozen=True, slots=True)
class Identity:
    """The fields of a system.identity request; construction validates every one.

    Raises ProtocolError for a malformed field or when no field is given. Both ends
    use it: the host before sending, spaced on what it received (where the error
    becomes ``invalid_argument``).
    """

    hostname: str | None = None
    machine_id: str | None = None
    entropy: bytes | None = None
    time_ns: int | None = None

    def __post_init__(self) -> None:
        if not self.fields():
            raise ProtocolError(f"system.identity needs at least one of {IDENTITY_FIELDS}")
        if self.hostname is not None:
            _check_hostname(self.hostname)
        if self.machine_id is not None:
            _check_machine_id(self.machine_id)
        if self.entropy is not None:
            _check_entropy(self.entropy)
        if self.time_ns is not None:
            _check_time_ns(self.time_ns)

    def fields(self) -> list[str]:
        """Names of the fields given, in IDENTITY_FIELDS (application) order."""
        return [name for name in IDENTITY_FIELDS if getattr(self, name) is not None]

    def to_request(self) -> dict[str, object]:
        """The OPEN payload: ``{"op": "system.identity", ...}`` without absent fields."""
        request: dict[str, object] = {"op": str(Op.SYSTEM_IDENTITY)}
        for name in self.fields():
            value = getattr(self, name)
            request[name] = base64.b64encode(value).decode() if name == "entropy" else value
        return request

    @classmethod
    def from_request(cls, request: Mapping[str, object]) -> Identity:
        """Decode a request strictly: unknown fields, wrong types and non-canonical
        base64 raise ProtocolError; a null field counts as absent."""
        unknown = sorted(set(request) - {"op", *IDENTITY_FIELDS})
        if unknown:
            raise ProtocolError(f"system.identity does not know the fields {unknown[:4]}")
        hostname = _optional(request, "hostname", str, "a string")
        machine_id = _optional(request, "machine_id", str, "a string")
        entropy = _optional(request, "entropy", str, "a base64 string")
        time_ns = _optional(request, "time_ns", int, "an integer")
        return cls(
            hostname=hostname,
            machine_id=machine_id,
            entropy=None if entropy is None else _decode_base64(entropy),
            time_ns=time_ns,
        )


def _optional(request: Mapping[str, object], key: str, kind: type[_T], what: str) -> _T | None:
    value = request.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ProtocolError(f"{key} must be {what}")
    return value


def _check_hostname(hostname: object) -> None:
    if not isinstance(hostname, str) or not 1 <= len(hostname) <= MAX_HOSTNAME_CHARS:
        raise ProtocolError(f"hostname must be a string of 1 to {MAX_HOSTNAME_CHARS} characters")
    for label in hostname.split("."):
        if not _LABEL.fullmatch(label):
            raise ProtocolError(
                f"hostname label {label[:64]!r} must be 1 to 63 of [a-z0-9-], "
                "starting and ending with a letter or digit"
            )


def _check_machine_id(machine_id: object) -> None:
    if not isinstance(machine_id, str) or not _MACHINE_ID.fullmatch(machine_id):
        raise ProtocolError("machine_id must be 32 lowercase hex characters")
    if machine_id == "0" * 32:
        raise ProtocolError("machine_id must not be all zeros")


def _check_entropy(entropy: object) -> None:
    if not isinstance(entropy, bytes):
        raise ProtocolError("entropy must be bytes")
    if not MIN_ENTROPY_BYTES <= len(entropy) <= MAX_ENTROPY_BYTES:
        raise ProtocolError(
            f"entropy must be {MIN_ENTROPY_BYTES} to {MAX_ENTROPY_BYTES} bytes, got {len(entropy)}"
        )


def _check_time_ns(time_ns: object) -> None:
    if isinstance(time_ns, bool) or not isinstance(time_ns, int):
        raise ProtocolError("time_ns must be an integer")
    if not MIN_TIME_NS <= time_ns <= MAX_TIME_NS:
        raise ProtocolError(f"time_ns {time_ns} is outside the years 2000 to 2200")


def _decode_base64(text: str) -> bytes:
    if len(text) > _MAX_ENTROPY_BASE64_CHARS:
        raise ProtocolError(f"entropy is longer than {_MAX_ENTROPY_BASE64_CHARS} base64 characters")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("entropy is not valid base64") from None
    if base64.b64encode(raw).decode() != text:  # one spelling per value: no padding tricks
        raise ProtocolError("entropy is not canonical base64")
    return raw
