"""``AsyncSecrets``: the tenant's secrets (set, list, get, delete). ``Secrets`` wraps it.

A secret is stored once, encrypted by the control plane; a sandbox created with
``secrets=["NAME"]`` sees only a placeholder in its environment variable ``env``, and its
node's egress gateway puts the value in the placeholder's place on requests to the
secret's ``hosts`` (or, with ``injection="header"``, sets header ``header`` to
``format`` with ``{value}`` replaced). The value is never sent back, nor put in any
error of this module.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Mapping, Sequence
from typing import Literal

import httpx

from space.sdk._http import ApiClient, client_config, json_object, listed
from space.sdk._models import SecretInfo
from space.sdk.errors import InvalidArgument

__all__ = ["AsyncSecrets"]

#: A secret's name, as the API takes it (also what makes it safe in a URL path).
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def _name(name: object, operation: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgument(
            f"a secret name is a letter or _ then up to 63 of [A-Za-z0-9_], not {name!r}",
            operation=operation,
        )
    return name


class AsyncSecrets:
    """Secrets of the key's tenant. Every method is a classmethod taking the connection
    like ``AsyncSandbox.create``: ``api_url``/``api_key``, else SPACE_API_URL /
    SPACE_API_KEY."""

    @classmethod
    async def set(
        cls,
        name: str,
        value: str,
        hosts: Sequence[str],
        *,
        env: str | None = None,
        injection: Literal["placeholder", "header"] = "placeholder",
        header: str | None = None,
        format: str = "{value}",
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> SecretInfo:
        """Create or replace secret ``name``; returns its metadata. Idempotent.

        ``hosts`` are domain patterns as in egress rules (``api.example.com``,
        ``*.example.com``); ``env`` the variable holding the placeholder in sandboxes
        (default: ``name``). Sandboxes already bound to it get the new value at once
        (those made later get placeholders in their environment; running ones keep the
        variable they were made with). Raises InvalidArgument (a malformed name or a
        ``hosts`` that is a string: nothing is sent; else the server's message naming
        the field, never quoting the value), AuthenticationError, Unavailable.
        """
        operation = "secret.set"
        if isinstance(hosts, str):
            raise InvalidArgument("hosts is a list of domain patterns, not a string",
                                  operation=operation)  # fmt: skip
        body = {"value": value, "hosts": list(hosts), "env": env, "injection": injection,
                "header": header, "format": format}  # fmt: skip
        path = f"/v1/secrets/{_name(name, operation)}"
        answer = await _call(
            "PUT", path, operation, api_url, api_key, request_timeout_s, _transport, body
        )
        return SecretInfo.from_wire(json_object(answer))

    @classmethod
    async def list(
        cls,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> builtins.list[SecretInfo]:
        """The tenant's secrets by name (metadata only). Read-only."""
        operation = "secret.list"
        answer = await _call(
            "GET", "/v1/secrets", operation, api_url, api_key, request_timeout_s, _transport
        )
        return [SecretInfo.from_wire(json_object(s)) for s in listed(answer, "secrets", operation)]

    @classmethod
    async def get(
        cls,
        name: str,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> SecretInfo:
        """Secret ``name``'s metadata. Raises NotFound, InvalidArgument (malformed name)."""
        operation = "secret.get"
        path = f"/v1/secrets/{_name(name, operation)}"
        answer = await _call(
            "GET", path, operation, api_url, api_key, request_timeout_s, _transport
        )
        return SecretInfo.from_wire(json_object(answer))

    @classmethod
    async def delete(
        cls,
        name: str,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """Delete secret ``name``; idempotent (a missing one is fine). Sandboxes bound to
        it stop getting it at once (their placeholders stay, and would be filled again by
        a new secret of that name). Raises InvalidArgument for a malformed name."""
        operation = "secret.delete"
        path = f"/v1/secrets/{_name(name, operation)}"
        await _call("DELETE", path, operation, api_url, api_key, request_timeout_s, _transport)


async def _call(
    method: str,
    path: str,
    operation: str,
    api_url: str | None,
    api_key: str | None,
    request_timeout_s: float | None,
    transport: httpx.AsyncBaseTransport | None,
    body: Mapping[str, object] | None = None,
) -> object:
    api = ApiClient(client_config(api_url, api_key, request_timeout_s, transport))
    try:
        return await api.request_json(method, path, operation=operation, json_body=body)
    finally:
        await api.aclose()
