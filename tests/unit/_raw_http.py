"""What the edge tests of both HTTP APIs (the control plane's and the node's) send
and read below httpx: a counted streamed body, and a connection the server closes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

#: The size of each chunk a StreamedBody yields.
CHUNK_BYTES = 64 * 1024


class StreamedBody:
    """A streamed request body of ``total`` bytes that records how much was taken."""

    def __init__(self, total: int, fill: bytes = b" ") -> None:
        self.total = total
        self.fill = fill
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while self.sent < self.total:
            size = min(CHUNK_BYTES, self.total - self.sent)
            self.sent += size
            yield self.fill * size


async def closed_by_server(reader: asyncio.StreamReader, within_s: float) -> bytes:
    """What the server sent before it closed the connection (TimeoutError if it did
    not close within ``within_s``)."""
    async with asyncio.timeout(within_s):
        return await reader.read()
