"""port.connect: a TCP connection to a server listening in the guest, relayed over one
stream (issue 20, port exposure; docs/protocol.md "Ports").

The host's INPUT DATA is written to the connection and what the server sends comes back
as OUTPUT DATA, both within the stream's credit, so a slow side backs up into the other
(TCP's own window in the guest, the channel's credit towards the host) and never into
memory. EOF INPUT half-closes the connection (SHUT_WR); the server's EOF is EOF OUTPUT.
The RESULT comes once both directions ended, or when neither moved for
``IDLE_TIMEOUT_S`` (``timeout``). The guest connects to 127.0.0.1 first, then ::1: a
server bound to either (or to a wildcard address) is reached; nothing listening is
``connection_refused``. Connections are counted per guest (``MAX_CONNECTIONS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from space.protocol import DATA_CHUNK_BYTES, Channel, ErrorCode

from ._errors import OpError
from ._request import Fields
from ._session import Stream

__all__ = [
    "CONNECT_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "PortConnections",
    "op_connect",
]

#: Most port.connect relays open at once in one guest: each holds a socket and up to
#: two windows (2 MiB) of buffers, so this bounds the guest memory tunnels take.
MAX_CONNECTIONS = 256
#: How long connecting to a local server may take (a listen backlog that is full).
CONNECT_TIMEOUT_S = 10.0
#: A relay with no byte in either direction this long is closed (a leaked tunnel).
IDLE_TIMEOUT_S = 600.0
#: The loopback addresses tried, in order.
_HOSTS = ("127.0.0.1", "::1")


class PortConnections:
    """The count of open relays; ``reserve`` refuses past MAX_CONNECTIONS."""

    def __init__(self, limit: int = MAX_CONNECTIONS) -> None:
        self.limit = limit
        self.open = 0

    @contextlib.contextmanager
    def reserve(self) -> Iterator[None]:
        if self.open >= self.limit:
            raise OpError(ErrorCode.RESOURCE_EXHAUSTED, f"{self.limit} port connections open")
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1


async def op_connect(
    stream: Stream, fields: Fields, connections: PortConnections, idle_timeout_s: float
) -> dict[str, object]:
    port = fields.integer("port", 0, low=1, high=65535)
    with connections.reserve():
        reader, writer = await _connect(port)
        try:
            await stream.send_event({"event": "connected", "port": port})
            return await _relay(stream, reader, writer, idle_timeout_s)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    for host in _HOSTS:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                return await asyncio.open_connection(host, port)
        except TimeoutError:
            raise OpError(
                ErrorCode.TIMEOUT, f"port {port} accepted no connection in {CONNECT_TIMEOUT_S} s"
            ) from None
        except OSError:
            continue  # refused, or no IPv6 in this guest: try the next address
    raise OpError(
        ErrorCode.CONNECTION_REFUSED, f"nothing listens on port {port} (127.0.0.1 or ::1)"
    )


class _Activity:
    def __init__(self) -> None:
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()


async def _relay(
    stream: Stream,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    idle_timeout_s: float,
) -> dict[str, object]:
    activity = _Activity()
    counts = {"bytes_in": 0, "bytes_out": 0}
    tasks = [
        asyncio.create_task(_upstream(stream, writer, activity, counts)),
        asyncio.create_task(_downstream(stream, reader, activity, counts)),
    ]
    try:
        while True:
            left = activity.last + idle_timeout_s - time.monotonic()
            _, pending = await asyncio.wait(tasks, timeout=max(left, 0.0))
            if not pending:
                break
            if time.monotonic() - activity.last >= idle_timeout_s:
                raise OpError(ErrorCode.TIMEOUT, f"no traffic for {idle_timeout_s} s")
        for task in tasks:
            task.result()  # a failure of either side is the stream's error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"ok": True, **counts}


async def _upstream(
    stream: Stream, writer: asyncio.StreamWriter, activity: _Activity, counts: dict[str, int]
) -> None:
    """INPUT to the server, credit granted as it is written; EOF half-closes."""
    broken = False
    while (data := await stream.read_input()) is not None:
        activity.touch()
        if not broken:
            try:
                writer.write(data)
                await writer.drain()
                counts["bytes_in"] += len(data)
            except (BrokenPipeError, ConnectionResetError):
                broken = True  # the server closed: the rest is discarded
        await stream.consumed(len(data) + 1)
    if not broken:
        with contextlib.suppress(OSError):
            writer.write_eof()


async def _downstream(
    stream: Stream, reader: asyncio.StreamReader, activity: _Activity, counts: dict[str, int]
) -> None:
    """The server's bytes as OUTPUT, within the host's credit; its EOF is EOF OUTPUT."""
    while True:
        try:
            chunk = await reader.read(DATA_CHUNK_BYTES - 1)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            break
        activity.touch()
        await stream.send_data(Channel.OUTPUT, chunk)
        counts["bytes_out"] += len(chunk)
        activity.touch()
    await stream.send_eof(Channel.OUTPUT)
