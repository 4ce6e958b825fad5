"""The edge of both HTTP APIs (issue 17): a request is authenticated, then its body
bounded, before any of the body is read.

A FastAPI dependency runs after the body it sits beside is parsed, so checking a key
there let a keyless client make the server read (and parse) a body of any size. The
``Edges`` ASGI middleware runs first, on the headers alone:

- ``authenticate(scope, headers)`` (the control plane's API key or node token, a node's
  own token) raises ``Refused`` (or one of the app's coded error classes) to refuse the
  request: no byte of the body is read;
- a body is then read in chunks up to ``max_body_bytes`` and handed on whole: a larger
  one (declared by Content-Length, or found while reading) is 413 (code
  ``resource_exhausted``, which is 429 elsewhere: here the request, not the server, is
  too big) and is not buffered
  past the cap. Routes in ``streamed_routes`` (file uploads, build contexts) are left to
  their own streamed caps.

An early refusal of a request with a body closes the connection (``Connection:
close``), so the unread rest of the body is never read either. The errors have the JSON
shape of space.node.api.http_errors. Connections themselves (header deadline and size,
per-client cap) are bounded by space.node.api.http_connections.

Not exported from space.node.api itself: it needs Starlette, which the gateway process
(which imports the contract) does not.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space.limits import MAX_JSON_BODY_BYTES
from space.node.api.http_errors import CodedError, error_body, status_for_code

__all__ = ["Authenticate", "Edges", "Refused", "RenderError", "StreamedRoute", "require_bearer"]

#: Checks a request from its scope and headers alone; raises to refuse it.
Authenticate = Callable[[Scope, Headers], Awaitable[None]]
#: (method, full path pattern) of a route whose body streams through with its own cap.
StreamedRoute = tuple[str, re.Pattern[str]]
#: The JSON body of a refusal from (status, code, message, details): by default the
#: shape of space.node.api.http_errors; an API of another shape (E2B's) passes its own.
RenderError = Callable[[int, str, str, dict[str, Any]], Any]


def _error_body(status: int, code: str, message: str, details: dict[str, Any]) -> Any:
    return error_body(code, message, details)


class Refused(Exception):
    """A request refused at the edge: answered ``STATUS_BY_CODE[code]`` in the error shape."""

    def __init__(self, code: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details: Mapping[str, Any] = details or {}


def require_bearer(headers: Headers, token: str, what: str) -> None:
    """Refused (unauthenticated) unless the request carries ``Bearer <token>``; compared
    in constant time. ``what`` names the credential in the refusal."""
    given = headers.get("authorization", "").encode()
    if not hmac.compare_digest(given, f"Bearer {token}".encode()):
        raise Refused("unauthenticated", f"missing or wrong {what}")


class _TooLarge(Exception):
    def __init__(self, observed_bytes: int) -> None:
        super().__init__(observed_bytes)
        self.observed_bytes = observed_bytes


class Edges:
    """ASGI middleware: authentication and the body cap, before the body is read.

    ``coded`` adds exception classes (CodedError: ``code``, ``message``, ``details``)
    that ``authenticate`` may raise besides ``Refused``; ``render`` shapes refusals.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        authenticate: Authenticate,
        streamed_routes: Sequence[StreamedRoute] = (),
        max_body_bytes: int = MAX_JSON_BODY_BYTES,
        coded: tuple[type[Exception], ...] = (),
        render: RenderError = _error_body,
    ) -> None:
        self.app = app
        self.authenticate = authenticate
        self.streamed_routes = tuple(streamed_routes)
        self.max_body_bytes = max_body_bytes
        self._refusals: tuple[type[Exception], ...] = (Refused, *coded)
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            await self.authenticate(scope, headers)
            if self._streamed(scope["method"], scope["path"]):
                await self.app(scope, receive, send)
                return
            body = await self._read_body(headers, receive)
        except _TooLarge as exc:
            message = f"request body over the {self.max_body_bytes}-byte limit"
            details = {"limit_bytes": self.max_body_bytes, "observed_bytes": exc.observed_bytes}
            body = self.render(413, "resource_exhausted", message, details)
            await _refuse(scope, receive, send, headers, 413, body)
            return
        except self._refusals as exc:
            coded: CodedError = exc  # type: ignore[assignment]  # Refused or a coded class
            status, details = status_for_code(coded.code), dict(coded.details)
            body = self.render(status, coded.code, coded.message, details)
            await _refuse(scope, receive, send, headers, status, body)
            return
        await self.app(scope, _replay(body, receive), send)

    def _streamed(self, method: str, path: str) -> bool:
        return any(method == m and p.fullmatch(path) for m, p in self.streamed_routes)

    async def _read_body(self, headers: Headers, receive: Receive) -> bytes:
        """The whole body, read in the chunks the server hands; _TooLarge past the cap
        (declared or read), without keeping more than the cap plus one chunk."""
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _TooLarge(int(declared))
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left: the app hears the disconnect itself
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                raise _TooLarge(size)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands ``body`` once, then the server's own messages."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


async def _refuse(
    scope: Scope,
    receive: Receive,
    send: Send,
    headers: Headers,
    status: int,
    body: Any,
) -> None:
    """Answer the error; with a body still on its way, close the connection after it."""
    has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
    response = JSONResponse(
        body,
        status_code=status,
        headers={"Connection": "close"} if has_body else None,
    )
    await response(scope, receive, send)
