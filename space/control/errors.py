"""Errors of the REST API and the one table mapping error codes to HTTP statuses.

    ApiError                   an error answered as ``{"error": {code, message, details}}``

Node errors (space.node.api.errors) carry the same ``code`` strings, so both are answered
through ``STATUS_BY_CODE`` by the installer both HTTP APIs share
(space.node.api.http_errors): request validation failures answer 422
``invalid_argument`` and anything unexpected 500 ``internal``. docs/api.md lists the
same table.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from space.control.node_text import scrub
from space.node.api import STATUS_BY_CODE
from space.node.api.http_errors import error_body, status_for_code
from space.node.api.http_errors import install_error_handlers as install_node_error_handlers

__all__ = [
    "STATUS_BY_CODE",
    "ApiError",
    "error_body",
    "install_error_handlers",
    "status_for_code",
]


class ApiError(Exception):
    """An error the API answers with ``STATUS_BY_CODE[code]`` and the JSON error shape."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        if code not in STATUS_BY_CODE:
            raise ValueError(f"unknown API error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` with the JSON error shape, ApiError included; a
    node error's text without node-internal names (space.control.node_text)."""
    install_node_error_handlers(app, ApiError, node_text=scrub)
