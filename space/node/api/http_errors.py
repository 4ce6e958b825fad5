"""How both HTTP APIs (the control plane's REST API and a node's own) answer errors.

One installer, one shape: ``{"error": {"code", "message", "details"}}`` with the status
``STATUS_BY_CODE[code]`` (space.node.api.wire, the one table), and a ``Retry-After``
header when the details name ``retry_after_s`` (a capacity refusal). Errors that carry a
code (``NodeError`` and any class the app adds, such as the control plane's
``ApiError``) answer with it; a malformed request (validation, JSON) answers 422
``invalid_argument`` with the fields at fault; a framework HTTP error keeps its status;
anything else is logged and answers 500 ``internal`` without its text.

Not exported from space.node.api itself: it needs FastAPI, which the gateway process
(which imports the contract) does not.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from space.node.api.errors import NodeError
from space.node.api.wire import STATUS_BY_CODE

__all__ = ["CodedError", "error_body", "install_error_handlers", "status_for_code"]

log = logging.getLogger(__name__)

# Framework-raised HTTP errors (unknown route, wrong method) keep their status; their
# code is the table's inverse, or the nearest client/server code.
_CODE_BY_STATUS = {status: code for code, status in STATUS_BY_CODE.items()}


class CodedError(Protocol):
    """An exception that names its own answer: a code of ``STATUS_BY_CODE``, a message
    and details (NodeError and the control plane's ApiError)."""

    code: str
    message: str

    @property
    def details(self) -> Mapping[str, Any]: ...


def status_for_code(code: str) -> int:
    """The HTTP status for an error code (500 for codes the table does not know)."""
    return STATUS_BY_CODE.get(code, 500)


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON error shape of docs/api.md."""
    return {"error": {"code": code, "message": message, "details": details or {}}}


def _respond(code: str, message: str, details: dict[str, Any] | None = None) -> JSONResponse:
    """The answer; details naming ``retry_after_s`` (whole seconds) add a Retry-After."""
    retry = (details or {}).get("retry_after_s")
    headers = None
    if isinstance(retry, int) and not isinstance(retry, bool) and retry > 0:
        headers = {"Retry-After": str(retry)}
    return JSONResponse(
        error_body(code, message, details), status_code=status_for_code(code), headers=headers
    )


async def _on_coded(_: Request, exc: Exception) -> JSONResponse:
    coded: CodedError = exc  # type: ignore[assignment]  # registered for coded classes only
    return _respond(coded.code, coded.message, dict(coded.details))


def _on_filtered(text: Callable[[str], str]) -> Callable[[Request, Exception], Any]:
    """Answer a coded error with ``text`` applied to its message and string details."""

    async def on_coded(_: Request, exc: Exception) -> JSONResponse:
        coded: CodedError = exc  # type: ignore[assignment]  # registered for coded classes
        details = {
            key: text(value) if isinstance(value, str) else value
            for key, value in coded.details.items()
        }
        return _respond(coded.code, text(coded.message), details)

    return on_coded


async def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError | ValidationError)
    errors = [
        {
            "field": ".".join(str(part) for part in err.get("loc", ()) if part != "body"),
            "message": str(err.get("msg", "invalid")),
        }
        for err in exc.errors()
    ]
    message = "; ".join(f"{e['field'] or 'body'}: {e['message']}" for e in errors)
    return _respond("invalid_argument", message or "invalid request", {"errors": errors})


async def _on_json_error(_: Request, exc: Exception) -> JSONResponse:
    return _respond("invalid_argument", f"body is not JSON: {exc}")


async def _on_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    default = "invalid_argument" if exc.status_code < 500 else "internal"
    code = _CODE_BY_STATUS.get(exc.status_code, default)
    body = error_body(code, str(exc.detail))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return _respond("internal", f"internal error: {type(exc).__name__}")


def install_error_handlers(
    app: FastAPI,
    *coded: type[Exception],
    handlers_parse_bodies: bool = False,
    node_text: Callable[[str], str] | None = None,
) -> None:
    """Answer every error of ``app`` in the JSON error shape (see the module docstring).

    ``node_text`` is applied to a NodeError's message and string details before they
    are answered (the control plane takes node-internal names out of them).

    ``coded`` adds exception classes with ``code``, ``message`` and ``details``
    attributes (CodedError), answered like node errors. ``handlers_parse_bodies``: the
    app's handlers parse request bodies themselves, so a pydantic or JSON error they
    raise is the request's fault (422), not the server's (500).
    """
    app.add_exception_handler(
        NodeError, _on_coded if node_text is None else _on_filtered(node_text)
    )
    for kind in coded:
        app.add_exception_handler(kind, _on_coded)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    if handlers_parse_bodies:
        app.add_exception_handler(ValidationError, _on_validation_error)
        app.add_exception_handler(json.JSONDecodeError, _on_json_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
