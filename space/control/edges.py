"""The REST API's edge (issue 17): a request is authenticated, then its body bounded,
before any of the body is read.

A FastAPI dependency runs after the body it sits beside is parsed, so checking the key
there let a keyless client make the server read (and parse) a body of any size. This
ASGI middleware runs first, on the headers alone:

- ``/v1/nodes`` needs the node token, every other ``/v1/`` route an API key: without
  one the answer is 401 and no byte of the body is read;
- a body is then read in chunks up to MAX_JSON_BODY_BYTES and handed on whole: a
  larger one (declared by Content-Length, or found while reading) is 413 and is not
  buffered past the cap. The two streamed routes (a file upload and a template build
  context) are left to their own streamed caps.

An early refusal of a request with a body closes the connection (``Connection:
close``), so the unread rest of the body is never read either. The errors have the
JSON shape of space.node.api.http_errors.
"""

from __future__ import annotations

import hmac
import re
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space.control.deps import ControlContext, authenticate
from space.control.errors import ApiError, error_body, status_for_code
from space.limits import MAX_JSON_BODY_BYTES

__all__ = ["STREAMED_ROUTES", "Edges"]

#: (method, path) of the routes whose bodies stream through with their own cap.
STREAMED_ROUTES = (
    ("PUT", re.compile(r"/v1/sandboxes/[^/]+/files")),
    ("POST", re.compile(r"/v1/templates")),
)
_NODE_ROUTES = "/v1/nodes"


class _TooLarge(Exception):
    def __init__(self, observed_bytes: int) -> None:
        super().__init__(observed_bytes)
        self.observed_bytes = observed_bytes


class Edges:
    """ASGI middleware: authentication and the body cap, before the body is read."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int = MAX_JSON_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            await _authenticate(scope, headers)
            if _streamed(scope["method"], scope["path"]):
                await self.app(scope, receive, send)
                return
            body = await self._read_body(headers, receive)
        except ApiError as exc:
            status = status_for_code(exc.code)
            await _refuse(scope, receive, send, headers, status, exc.code, exc.message, exc.details)
            return
        except _TooLarge as exc:
            message = f"request body over the {self.max_body_bytes}-byte limit"
            details = {"limit_bytes": self.max_body_bytes, "observed_bytes": exc.observed_bytes}
            await _refuse(
                scope, receive, send, headers, 413, "resource_exhausted", message, details
            )
            return
        await self.app(scope, _replay(body, receive), send)

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


def _streamed(method: str, path: str) -> bool:
    return any(method == m and pattern.fullmatch(path) for m, pattern in STREAMED_ROUTES)


async def _authenticate(scope: Scope, headers: Headers) -> None:
    """Check the key a ``/v1/`` route needs and keep the tenant in the request's state
    (deps.Tenant reads it there). Raises ApiError(unauthenticated)."""
    path: str = scope["path"]
    if not path.startswith("/v1/"):
        return
    ctx: ControlContext = scope["app"].state.ctx
    if path == _NODE_ROUTES or path.startswith(_NODE_ROUTES + "/"):
        expected = f"Bearer {ctx.node_token}".encode()
        if not hmac.compare_digest(headers.get("authorization", "").encode(), expected):
            raise ApiError("unauthenticated", "missing or wrong node token")
        return
    scope.setdefault("state", {})["tenant"] = await authenticate(ctx, headers)


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
    code: str,
    message: str,
    details: dict[str, Any],
) -> None:
    """Answer the error; with a body still on its way, close the connection after it."""
    has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
    response = JSONResponse(
        error_body(code, message, details),
        status_code=status,
        headers={"Connection": "close"} if has_body else None,
    )
    await response(scope, receive, send)
