"""The connections of both HTTP API servers (issue 17): a deadline for a request's
headers, a cap on their size, and a cap on one client's open connections.

uvicorn's httptools protocol arms no timer before a request's headers are complete
(its keep-alive timer runs only between requests, and any byte cancels it), so a
client could hold thousands of connections open by sending nothing, or a header byte
now and then (measured: 19,800 half-sent requests held for 20 s). ``guarded_protocol``
makes a subclass that closes a connection whose headers are not complete
``header_timeout_s`` after it opened (or after its request began), answers 400 and
closes for headers over ``max_header_bytes``, and closes at once a connection from a
client address that already has ``max_per_client`` open. Bodies are bounded by
space.node.api.http_edges. The control plane's REST API and a node's own API both serve
with it.

Not exported from space.node.api itself: it needs uvicorn, which the gateway process
(which imports the contract) does not.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = [
    "HEADER_TIMEOUT_S",
    "MAX_CONNECTIONS_PER_CLIENT",
    "MAX_HEADER_BYTES",
    "guarded_protocol",
]

#: Seconds a client has to send a request line and headers (nginx's
#: client_header_timeout defaults to 60 s; an API client sends them at once).
HEADER_TIMEOUT_S = 10.0
#: Bytes of request line and headers (nginx accepts 4 x 8 KiB by default).
MAX_HEADER_BYTES = 64 * 1024
#: Open connections one client address may hold (an SDK client pools up to 100).
MAX_CONNECTIONS_PER_CLIENT = 256


def guarded_protocol(
    *,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    max_header_bytes: int = MAX_HEADER_BYTES,
    max_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
) -> type[asyncio.Protocol]:
    """An httptools protocol class for ``uvicorn.Config(http=...)`` with these bounds;
    each call counts its own connections (one server each)."""
    open_by_client: Counter[str] = Counter()

    def release(host: str) -> None:
        open_by_client[host] -= 1
        if not open_by_client[host]:
            del open_by_client[host]

    class GuardedHttp(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._header_bytes = 0
            self._counted: str | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else ""
            if open_by_client[host] >= max_per_client:
                transport.close()
                return
            open_by_client[host] += 1
            self._counted = host
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            if self._counted is not None:
                release(self._counted)
                self._counted = None
            super().connection_lost(exc)

        def handle_websocket_upgrade(self) -> None:
            # The WebSocket protocol takes the transport over: this one never hears
            # connection_lost, so the count moves to the WebSocket's (issue 20).
            self._disarm_header_timer()
            counted, self._counted = self._counted, None
            super().handle_websocket_upgrade()
            if counted is None:
                return
            websocket = self.transport.get_protocol()
            lost = websocket.connection_lost

            def released(exc: Exception | None) -> None:
                release(counted)
                lost(exc)

            websocket.connection_lost = released  # type: ignore[method-assign]

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0
            if self._header_timer is None:
                self._arm_header_timer()

        def on_url(self, url: bytes) -> None:
            self._count_header_bytes(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_header_bytes(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm_header_timer()
            super().on_headers_complete()

        def _count_header_bytes(self, size: int) -> None:
            self._header_bytes += size
            if self._header_bytes > max_header_bytes and not self.transport.is_closing():
                self.send_400_response("Request headers too large.")

        def _arm_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedHttp
