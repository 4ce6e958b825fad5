"""The Connect protocol (connectrpc.com/docs/protocol), JSON codec only: what E2B's SDK
speaks to its in-sandbox daemon (space.control.e2b.envd serves it).

- Unary: ``POST /<service>/<Method>``, ``Content-Type: application/json``, the body one
  message; the answer is 200 with one message, or an error status with
  ``{"code": "<connect code>", "message"}``.
- Server streaming: ``application/connect+json``; the request is one envelope (a flags
  byte, a big-endian 32-bit length, the message); the answer is 200 and envelopes, the
  last one flagged END_STREAM carrying ``{}`` or ``{"error": {"code", "message"}}``.
- Client streaming: the request is envelopes until the body ends; the answer is one
  message envelope and the end-stream envelope.

Every envelope and body is bounded (MAX_MESSAGE_BYTES) before it is read whole;
compressed envelopes are refused (the SDK sends none: ENVD_RPC_COMPRESSION). Messages
are protobuf JSON: camelCase names (the proto names are accepted too), bytes in base64,
64-bit integers as strings, enums by name.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import re
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.types import Message, Receive, Send

from space.control.errors import ApiError
from space.control.node_text import scrub
from space.node.api.errors import NodeError

__all__ = [
    "CONNECT_JSON",
    "FLAG_COMPRESSED",
    "FLAG_END_STREAM",
    "HTTP_STATUS",
    "MAX_MESSAGE_BYTES",
    "UNARY_JSON",
    "Code",
    "ConnectError",
    "Fields",
    "b64",
    "connect_error_of",
    "end_stream",
    "envelope",
    "parse_message",
    "read_body",
    "read_envelopes",
    "send_unary",
    "send_unary_error",
    "stream_start",
    "timeout_of",
]

UNARY_JSON = "application/json"
CONNECT_JSON = "application/connect+json"
#: The largest message, request or response, we read or accept: a 1 MiB stdin write
#: (space.limits.MAX_STDIN_BYTES) is 1.4 MiB as base64 JSON.
MAX_MESSAGE_BYTES = 2 * 1024 * 1024
#: Envelope flags (the protocol's): a compressed message, and the end of a stream.
FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
_HEADER = struct.Struct(">BI")


class Code(enum.StrEnum):
    CANCELED = "canceled"
    UNKNOWN = "unknown"
    INVALID_ARGUMENT = "invalid_argument"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    FAILED_PRECONDITION = "failed_precondition"
    ABORTED = "aborted"
    OUT_OF_RANGE = "out_of_range"
    UNIMPLEMENTED = "unimplemented"
    INTERNAL = "internal"
    UNAVAILABLE = "unavailable"
    DATA_LOSS = "data_loss"
    UNAUTHENTICATED = "unauthenticated"


#: The HTTP status of a unary error, as the protocol maps each code.
HTTP_STATUS: Mapping[Code, int] = {
    Code.CANCELED: 499,
    Code.UNKNOWN: 500,
    Code.INVALID_ARGUMENT: 400,
    Code.DEADLINE_EXCEEDED: 504,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.PERMISSION_DENIED: 403,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.FAILED_PRECONDITION: 400,
    Code.ABORTED: 409,
    Code.OUT_OF_RANGE: 400,
    Code.UNIMPLEMENTED: 501,
    Code.INTERNAL: 500,
    Code.UNAVAILABLE: 503,
    Code.DATA_LOSS: 500,
    Code.UNAUTHENTICATED: 401,
}

#: Our error codes (NodeError.code, ApiError.code) as Connect codes: the one table of
#: this boundary. ``conflict`` is a state that does not allow the call; where it means
#: "exists" (MakeDir) the caller says so.
_CODE_OF: Mapping[str, Code] = {
    "not_found": Code.NOT_FOUND,
    "conflict": Code.FAILED_PRECONDITION,
    "invalid_argument": Code.INVALID_ARGUMENT,
    "permission_denied": Code.PERMISSION_DENIED,
    "resource_exhausted": Code.RESOURCE_EXHAUSTED,
    "timeout": Code.DEADLINE_EXCEEDED,
    "unavailable": Code.UNAVAILABLE,
    "capacity": Code.UNAVAILABLE,
    "unauthenticated": Code.UNAUTHENTICATED,
}


class ConnectError(Exception):
    """An RPC's error as the client gets it: a Connect code and a message."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def body(self) -> dict[str, str]:
        return {"code": self.code.value, "message": self.message}


def connect_error_of(exc: NodeError | ApiError, *, conflict: Code | None = None) -> ConnectError:
    """``exc`` (a node's or the API's error) as the client sees it, node words scrubbed;
    ``conflict`` overrides what a Conflict becomes."""
    code = _CODE_OF.get(exc.code, Code.INTERNAL)
    if exc.code == "conflict" and conflict is not None:
        code = conflict
    return ConnectError(code, scrub(exc.message))


def b64(data: bytes) -> str:
    """Bytes as protobuf JSON writes them."""
    return base64.b64encode(data).decode("ascii")


def envelope(message: Mapping[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(flags, len(payload)) + payload


def end_stream(error: ConnectError | None) -> bytes:
    """The envelope that ends a streaming answer: ``{}``, or the error."""
    return envelope({} if error is None else {"error": error.body()}, FLAG_END_STREAM)


def timeout_of(headers: Mapping[str, str]) -> float | None:
    """``Connect-Timeout-Ms`` in seconds (None: absent); at most 10 digits, as the
    protocol allows. Raises ConnectError(invalid_argument) for anything else."""
    text = headers.get("connect-timeout-ms")
    if text is None:
        return None
    if not re.fullmatch(r"[0-9]{1,10}", text):
        raise ConnectError(Code.INVALID_ARGUMENT, "Connect-Timeout-Ms must be 1 to 10 digits")
    return int(text) / 1000


async def read_body(receive: Receive, limit: int = MAX_MESSAGE_BYTES) -> bytes:
    """The whole request body, refused past ``limit`` bytes before more is read."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectError(Code.CANCELED, "the client went away")
        body += message.get("body", b"")
        if len(body) > limit:
            raise ConnectError(
                Code.RESOURCE_EXHAUSTED, f"request of more than {limit} bytes (the limit)"
            )
        if not message.get("more_body", False):
            return bytes(body)


def parse_message(data: bytes) -> dict[str, Any]:
    """One JSON message; ConnectError(invalid_argument) unless it is a JSON object."""
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ConnectError(Code.INVALID_ARGUMENT, "the message is not valid JSON") from None
    if not isinstance(value, dict):
        raise ConnectError(Code.INVALID_ARGUMENT, "the message is not a JSON object")
    return value


async def read_envelopes(
    receive: Receive, limit: int = MAX_MESSAGE_BYTES
) -> AsyncIterator[dict[str, Any]]:
    """The messages of an enveloped request body, as they arrive, until it ends.

    Raises ConnectError: invalid_argument for a truncated envelope or a malformed
    message, resource_exhausted for an envelope past ``limit`` (refused from its header,
    before its bytes are read), unimplemented for a compressed one.
    """
    buffer = bytearray()
    more = True
    while True:
        while len(buffer) >= _HEADER.size:
            flags, length = _HEADER.unpack_from(buffer)
            if length > limit:
                raise ConnectError(
                    Code.RESOURCE_EXHAUSTED,
                    f"message of {length} bytes exceeds the limit of {limit}",
                )
            if flags & FLAG_COMPRESSED:
                raise ConnectError(Code.UNIMPLEMENTED, "compressed messages are not supported")
            if len(buffer) < _HEADER.size + length:
                break
            data = bytes(buffer[_HEADER.size : _HEADER.size + length])
            del buffer[: _HEADER.size + length]
            yield parse_message(data)
        if not more:
            if buffer:
                raise ConnectError(Code.INVALID_ARGUMENT, "the request ends inside an envelope")
            return
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectError(Code.CANCELED, "the client went away")
        buffer += message.get("body", b"")
        more = message.get("more_body", False)


async def _send_json(send: Send, status: int, body: Mapping[str, Any]) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    headers = [
        (b"content-type", UNARY_JSON.encode()),
        (b"content-length", str(len(payload)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def send_unary(send: Send, message: Mapping[str, Any]) -> None:
    await _send_json(send, 200, message)


async def send_unary_error(send: Send, error: ConnectError) -> None:
    await _send_json(send, HTTP_STATUS[error.code], error.body())


def stream_start() -> Message:
    return {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", CONNECT_JSON.encode())],
    }


@dataclass(frozen=True)
class Fields:
    """A request message read defensively: every getter checks the JSON type and bounds
    and raises ConnectError(invalid_argument) naming the field. Both the camelCase and
    the proto name of a field are accepted, as protobuf JSON parsers do."""

    message: Mapping[str, Any]
    where: str = ""

    def _get(self, name: str) -> Any:
        camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), name)
        value = self.message.get(camel)
        return self.message.get(name) if value is None else value

    def _bad(self, name: str, what: str) -> ConnectError:
        return ConnectError(Code.INVALID_ARGUMENT, f"{self.where}{name} must be {what}")

    def has(self, name: str) -> bool:
        return self._get(name) is not None

    def string(self, name: str, *, max_chars: int = 4096, default: str = "") -> str:
        value = self._get(name)
        if value is None:
            return default
        if not isinstance(value, str) or len(value) > max_chars or "\0" in value:
            raise self._bad(name, f"a string of at most {max_chars} characters without NUL")
        return value

    def integer(self, name: str, *, low: int = 0, high: int = 2**32 - 1) -> int:
        value = self._get(name)
        if value is None:
            return 0 if low <= 0 <= high else low
        if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,20}", value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self._bad(name, f"an integer from {low} to {high}")
        return value

    def boolean(self, name: str) -> bool:
        value = self._get(name)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise self._bad(name, "true or false")
        return value

    def data(self, name: str, *, max_bytes: int) -> bytes:
        value = self._get(name)
        if value is None:
            return b""
        if not isinstance(value, str) or len(value) > (max_bytes + 2) // 3 * 4 + 4:
            raise self._bad(name, f"base64 of at most {max_bytes} bytes")
        try:
            standard = value.replace("-", "+").replace("_", "/")
            data = base64.b64decode(standard + "=" * (-len(standard) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise self._bad(name, "base64") from None
        if len(data) > max_bytes:
            raise self._bad(name, f"base64 of at most {max_bytes} bytes")
        return data

    def enum(self, name: str, values: Mapping[str, int]) -> int:
        value = self._get(name)
        if value is None:
            return 0
        if isinstance(value, str) and value in values:
            return values[value]
        if isinstance(value, int) and not isinstance(value, bool) and value in values.values():
            return value
        raise self._bad(name, "one of " + ", ".join(values))

    def strings(self, name: str, *, max_items: int, max_chars: int = 65536) -> list[str]:
        value = self._get(name)
        if value is None:
            return []
        if not isinstance(value, list) or len(value) > max_items:
            raise self._bad(name, f"a list of at most {max_items} strings")
        return [
            Fields({"v": item}, f"{self.where}{name}[].").string("v", max_chars=max_chars)
            for item in value
        ]

    def string_map(self, name: str, *, max_items: int) -> dict[str, str]:
        value = self._get(name)
        if value is None:
            return {}
        if not isinstance(value, dict) or len(value) > max_items:
            raise self._bad(name, f"an object of at most {max_items} strings")
        out = {}
        for key, item in value.items():
            if not isinstance(item, str):
                raise self._bad(name, "an object of strings")
            out[key] = item
        return out

    def sub(self, name: str) -> Fields | None:
        """The nested message ``name``, or None if absent."""
        value = self._get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self._bad(name, "an object")
        return Fields(value, f"{self.where}{name}.")

    def oneof(self, *names: str) -> tuple[str, Any] | None:
        """The one member of a oneof that is set, as (name, raw value), or None."""
        present = [(name, self._get(name)) for name in names if self._get(name) is not None]
        if len(present) > 1:
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"{self.where}: at most one of {', '.join(names)}"
            )
        return present[0] if present else None


#: Serves one RPC: a unary handler answers one message; a server-streaming one yields
#: messages; a client-streaming one reads messages and answers one.
Unary = Callable[[Fields], Awaitable[dict[str, Any]]]
ServerStream = Callable[[Fields], AsyncIterator[dict[str, Any]]]
ClientStream = Callable[[AsyncIterator[Fields]], Awaitable[dict[str, Any]]]
