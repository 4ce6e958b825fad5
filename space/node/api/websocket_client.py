"""A small WebSocket client (RFC 6455, through wsproto) over any byte stream.

Two users (issue 20, port exposure): RemoteNode's port tunnels (over TCP or TLS to a
node's API) and the control plane's proxy of a tenant's WebSocket to a server in a
sandbox (over a PortTunnel). The stream is anything with PortTunnel's ``read``,
``write``, ``aclose``; ``StreamPipe`` adapts an asyncio stream pair.

Bounds: a message is at most ``max_message_bytes`` (a larger one fails the
connection with 1009), the handshake answer must come within ``handshake_timeout_s``.
Errors raise ``WebSocketError``; the caller maps it to its own tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Sequence
from typing import Protocol
from urllib.parse import urlsplit

import wsproto
import wsproto.events as ev
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

__all__ = [
    "MAX_MESSAGE_BYTES",
    "ByteStream",
    "StreamPipe",
    "WebSocketClient",
    "WebSocketError",
    "connect_tcp",
]

#: Largest message assembled from frames (uvicorn's own default for servers).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 30.0


class WebSocketError(Exception):
    """The handshake was refused (``status``), or the connection broke."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ByteStream(Protocol):
    async def read(self) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def aclose(self) -> None: ...


class StreamPipe:
    """An asyncio (reader, writer) pair as a ByteStream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self) -> bytes:
        return await self._reader.read(256 * 1024)

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()


async def connect_tcp(url: str, verify: ssl.SSLContext | bool) -> tuple[StreamPipe, str, str]:
    """Open TCP (TLS for https/wss) to ``url``'s host; (pipe, host header, target)."""
    parts = urlsplit(url)
    secure = parts.scheme in ("https", "wss")
    context: ssl.SSLContext | None = None
    if secure:
        context = verify if isinstance(verify, ssl.SSLContext) else ssl.create_default_context()
        if verify is False:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    port = parts.port or (443 if secure else 80)
    reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=context)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    return StreamPipe(reader, writer), parts.netloc, target


class WebSocketClient:
    """One client connection; ``handshake`` first, then ``receive``/``send``."""

    def __init__(self, stream: ByteStream, *, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._stream = stream
        self._ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        self._max = max_message_bytes
        self._events: list[ev.Event] = []
        self._parts: list[bytes | str] = []
        self._size = 0
        self._closed = False
        self.subprotocol: str | None = None
        self.close_code: int | None = None
        self.close_reason = ""

    async def handshake(
        self,
        host: str,
        target: str,
        headers: Sequence[tuple[bytes, bytes]] = (),
        subprotocols: Sequence[str] = (),
        timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> list[tuple[bytes, bytes]]:
        """Send the upgrade request; return the accepting answer's headers.

        Raises WebSocketError with the status of a refusal (its body is not read).
        """
        request = ev.Request(
            host=host, target=target, extra_headers=list(headers), subprotocols=list(subprotocols)
        )
        await self._send(request)
        async with asyncio.timeout(timeout_s):
            while True:
                event = await self._next_event()
                if isinstance(event, ev.AcceptConnection):
                    self.subprotocol = event.subprotocol
                    return list(event.extra_headers)
                if isinstance(event, ev.RejectConnection):
                    raise WebSocketError(
                        f"handshake refused: {event.status_code}", event.status_code
                    )

    async def receive(self) -> bytes | str | None:
        """The next whole message; None once the connection closed."""
        while not self._closed:
            event = await self._next_event()
            if isinstance(event, ev.Message):
                self._size += len(event.data)
                if self._size > self._max:
                    await self.close(1009, "message too big")
                    raise WebSocketError(f"message over {self._max} bytes")
                self._parts.append(event.data)
                if event.message_finished:
                    parts, self._parts, self._size = self._parts, [], 0
                    if isinstance(event, ev.TextMessage):
                        return "".join(str(p) for p in parts)
                    return b"".join(bytes(p) for p in parts)  # type: ignore[arg-type]
            elif isinstance(event, ev.Ping):
                await self._send(event.response())
            elif isinstance(event, ev.CloseConnection):
                self.close_code, self.close_reason = event.code, event.reason or ""
                if self._ws.state is wsproto.connection.ConnectionState.REMOTE_CLOSING:
                    with contextlib.suppress(Exception):
                        await self._send(event.response())
                self._closed = True
        return None

    async def send(self, message: bytes | str) -> None:
        if isinstance(message, str):
            await self._send(ev.TextMessage(data=message))
        else:
            await self._send(ev.BytesMessage(data=message))

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Send a close frame (if still open) and close the stream. Idempotent."""
        if not self._closed and self._ws.state is wsproto.connection.ConnectionState.OPEN:
            with contextlib.suppress(Exception):
                await self._send(ev.CloseConnection(code=code, reason=reason))
        self._closed = True
        await self._stream.aclose()

    async def _send(self, event: ev.Event) -> None:
        try:
            data = self._ws.send(event)
        except LocalProtocolError as exc:
            raise WebSocketError(f"cannot send: {exc}") from None
        await self._stream.write(data)

    async def _next_event(self) -> ev.Event:
        while not self._events:
            data = await self._stream.read()
            if not data:
                self._closed = True
                return ev.CloseConnection(code=1006, reason="connection lost")
            try:
                self._ws.receive_data(data)
                self._events.extend(self._ws.events())
            except RemoteProtocolError as exc:
                raise WebSocketError(f"protocol error: {exc}") from None
        return self._events.pop(0)
