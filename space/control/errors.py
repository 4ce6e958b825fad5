"""Errors of the REST API and the one table mapping error codes to HTTP statuses.

    ApiError                   an error answered as ``{"error": {code, message, details}}``

Node errors (space.node.api.errors) carry the same ``code`` strings, so both are answered
through ``STATUS_BY_CODE``; request validation failures answer 422 ``invalid_argument``
and anything unexpected 500 ``internal``. docs/api.md lists the same table.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from space.node.api import STATUS_BY_CODE, NodeError

__all__ = [
    "STATUS_BY_CODE",
    "ApiError",
    "error_body",
    "install_error_handlers",
    "status_for_code",
]

log = logging.getLogger(__name__)


# Framework-raised HTTP errors (unknown route, wrong method) keep their status; their
# code is the table's inverse, or the nearest client/server code.
_CODE_BY_STATUS = {status: code for code, status in STATUS_BY_CODE.items()}


class ApiError(Exception):
    """An error the API answers with ``STATUS_BY_CODE[code]`` and the JSON error shape."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        if code not in STATUS_BY_CODE:
            raise ValueError(f"unknown API error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details


def status_for_code(code: str) -> int:
    """The HTTP status for an error code (500 for codes the table does not know)."""
    return STATUS_BY_CODE.get(code, 500)


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON error shape of docs/api.md."""
    return {"error": {"code": code, "message": message, "details": details or {}}}


def _respond(code: str, message: str, details: dict[str, Any] | None = None) -> JSONResponse:
    return JSONResponse(error_body(code, message, details), status_code=status_for_code(code))


def _validation_message(exc: RequestValidationError) -> tuple[str, list[dict[str, str]]]:
    errors = [
        {
            "field": ".".join(str(part) for part in err.get("loc", ()) if part != "body"),
            "message": str(err.get("msg", "invalid")),
        }
        for err in exc.errors()
    ]
    text = "; ".join(f"{e['field'] or 'body'}: {e['message']}" for e in errors)
    return text or "invalid request", errors


async def _on_api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _respond(exc.code, exc.message, exc.details)


async def _on_node_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, NodeError)
    details = {"sandbox_id": exc.sandbox_id} if exc.sandbox_id else {}
    return _respond(exc.code, exc.message, details)


async def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, errors = _validation_message(exc)
    return _respond("invalid_argument", message, {"errors": errors})


async def _on_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    default = "invalid_argument" if exc.status_code < 500 else "internal"
    code = _CODE_BY_STATUS.get(exc.status_code, default)
    body = error_body(code, str(exc.detail))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return _respond("internal", f"internal error: {type(exc).__name__}")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` with the JSON error shape."""
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(NodeError, _on_node_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
