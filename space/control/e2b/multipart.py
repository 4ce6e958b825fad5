"""A streaming reader of ``multipart/form-data`` request bodies (RFC 7578), for envd's
``POST /files``: each part's bytes are handed on as they arrive, never held whole.

Bounded: the boundary (RFC 2046: at most 70 characters), a part's headers
(MAX_HEADER_BYTES) and the number of parts (MAX_PARTS); a body that breaks the format
raises MultipartError.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import Receive

__all__ = [
    "MAX_HEADER_BYTES",
    "MAX_PARTS",
    "MultipartError",
    "MultipartReader",
    "Part",
    "boundary_of",
]

MAX_HEADER_BYTES = 16 * 1024
MAX_PARTS = 64
_BOUNDARY_RE = re.compile(r'boundary=(?:"([^"]{1,70})"|([^;\s"]{1,70}))(?=;|\s|$)', re.IGNORECASE)
_DISPOSITION_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class MultipartError(Exception):
    """A body that is not the multipart form it says it is, or past a bound."""


def boundary_of(content_type: str) -> bytes:
    match = _BOUNDARY_RE.search(content_type)
    if match is None:
        raise MultipartError("multipart/form-data without a boundary of 1 to 70 characters")
    return (match.group(1) or match.group(2)).encode()


@dataclass(frozen=True)
class Part:
    name: str
    filename: str | None


class MultipartReader:
    """``async for part in reader``: then read that part's bytes with ``reader.data()``
    before asking for the next part (what is left of it is skipped)."""

    def __init__(self, receive: Receive, boundary: bytes) -> None:
        self._receive = receive
        self._delimiter = b"\r\n--" + boundary
        self._buffer = bytearray(b"\r\n")  # the first delimiter has no CRLF before it
        self._more = True
        self._in_part = False
        self._done = False
        self._parts = 0

    async def _fill(self) -> bool:
        if not self._more:
            return False
        message = await self._receive()
        if message["type"] == "http.disconnect":
            raise MultipartError("the client went away")
        self._buffer += message.get("body", b"")
        self._more = message.get("more_body", False)
        return True

    async def _find(self, token: bytes, limit: int) -> int:
        while (index := self._buffer.find(token)) < 0:
            if len(self._buffer) > limit:
                raise MultipartError(f"no {token!r} within {limit} bytes")
            if not await self._fill():
                raise MultipartError("the body ends inside a part")
        return index

    def __aiter__(self) -> MultipartReader:
        return self

    async def __anext__(self) -> Part:
        if self._in_part:
            async for _ in self.data():
                pass
        if self._done:
            raise StopAsyncIteration
        if self._parts == 0:
            index = await self._find(self._delimiter, MAX_HEADER_BYTES)
            del self._buffer[: index + len(self._delimiter)]
        while len(self._buffer) < 2:
            if not await self._fill():
                raise MultipartError("the body ends after a delimiter")
        if self._buffer[:2] == b"--":
            self._done = True
            raise StopAsyncIteration
        if self._parts >= MAX_PARTS:
            raise MultipartError(f"more than {MAX_PARTS} parts")
        end = await self._find(b"\r\n\r\n", MAX_HEADER_BYTES)
        headers = bytes(self._buffer[:end]).decode("utf-8", "replace")
        del self._buffer[: end + 4]
        self._parts += 1
        self._in_part = True
        return _part_of(headers)

    async def data(self) -> AsyncIterator[bytes]:
        """The current part's bytes, as they arrive."""
        keep = len(self._delimiter)
        while self._in_part:
            index = self._buffer.find(self._delimiter)
            if index >= 0:
                chunk = bytes(self._buffer[:index])
                del self._buffer[: index + keep]
                self._in_part = False
                if chunk:
                    yield chunk
                return
            if len(self._buffer) > keep:
                chunk = bytes(self._buffer[: len(self._buffer) - keep])
                del self._buffer[: len(chunk)]
                yield chunk
            if not await self._fill():
                raise MultipartError("the body ends inside a part")


def _part_of(headers: str) -> Part:
    for line in headers.split("\r\n"):
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-disposition":
            fields = dict(_DISPOSITION_RE.findall(value))
            return Part(fields.get("name", ""), fields.get("filename"))
    raise MultipartError("a part without Content-Disposition")
