"""How the E2B-shaped API answers errors: ``{"code": <HTTP status>, "message": "..."}``.

The E2B SDK reads the status and the message (e2b.api.handle_api_exception): 401 is its
AuthenticationException, 429 RateLimitException, 503 ServiceBusyException (retried by
it: see ``_retry_headers``), 404 on a sandbox route SandboxNotFoundException, 409 on
pause "already paused"; anything else a SandboxException carrying the status. So every
failure of these routes, our coded errors, request validation and the unexpected alike,
answers in that shape:

    our code             status   (STATUS_BY_CODE, but:)
    invalid_argument     400      E2B answers a bad request 400, not 422
    everything else      STATUS_BY_CODE[code] (unknown codes 500)

``E2BRoute`` (the router's route class) does it for everything raised while a request
is handled (dependencies and validation included); ``render_refusal`` for what the edge
refuses before the body is read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from space.control.errors import ApiError
from space.control.node_text import scrub
from space.node.api import NodeError
from space.node.api.http_errors import status_for_code

__all__ = ["E2BError", "E2BRoute", "e2b_error", "render_refusal", "status_of"]

log = logging.getLogger(__name__)

#: Our codes whose E2B status differs from STATUS_BY_CODE.
_E2B_STATUS = {"invalid_argument": 400}


class E2BError(Exception):
    """An error answered as ``{"code": status, "message": message}`` with that status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def status_of(code: str) -> int:
    """The E2B status for one of our error codes."""
    return _E2B_STATUS.get(code, status_for_code(code))


def e2b_error(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The E2B error answer."""
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


def render_refusal(status: int, code: str, message: str, details: dict[str, Any]) -> Any:
    """An edge refusal (space.node.api.http_edges.RenderError) in E2B's shape."""
    return {"code": status, "message": message}


def _answer(exc: Exception) -> JSONResponse:
    if isinstance(exc, E2BError):
        return e2b_error(exc.status, exc.message)
    if isinstance(exc, ApiError | NodeError):
        return e2b_error(status_of(exc.code), scrub(exc.message), _retry_headers(exc.details))
    if isinstance(exc, RequestValidationError | ValidationError):
        # ValidationError: our own request, made from E2B's, refused it (the template).
        return e2b_error(400, _validation_message(exc))
    if isinstance(exc, HTTPException):
        return e2b_error(exc.status_code, str(exc.detail))
    log.exception("unhandled error on an E2B route", exc_info=exc)
    return e2b_error(500, f"internal error: {type(exc).__name__}")


def _retry_headers(details: Mapping[str, Any]) -> dict[str, str]:
    """The SDK retries a 429, 502, 503 or 504 unless told ``Should-Retry: false``, after
    ``Retry-After`` seconds if given. An error naming a sandbox left something behind (a
    create whose sandbox failed is kept in state ``error``): a retry would make another,
    so it is told not to; a refusal that made nothing (capacity, quota) may be retried."""
    headers = {}
    retry = details.get("retry_after_s")
    if isinstance(retry, int) and not isinstance(retry, bool) and retry > 0:
        headers["Retry-After"] = str(retry)
    if details.get("sandbox_id"):
        headers["Should-Retry"] = "false"
    return headers


def _validation_message(exc: RequestValidationError | ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
        parts.append(f"{where or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


class E2BRoute(APIRoute):
    """A route whose every failure answers in E2B's error shape (see the module doc)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # every failure answers in E2B's shape
                return _answer(exc)

        return handle
