"""``AsyncSecretStore`` (``space.secrets``): the tenant's secrets (set, list, get,
delete); ``AsyncSecrets`` makes the same calls on a connection of its own per call.
The sync ``Secrets`` wraps it.

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
from collections.abc import Sequence
from typing import Literal

import httpx

from space.sdk._http import ApiClient, json_object, listed, one_call, same_contract
from space.sdk._models import SecretInfo
from space.sdk.errors import InvalidArgument

__all__ = ["AsyncSecretStore", "AsyncSecrets"]

#: A secret's name, as the API takes it (also what makes it safe in a URL path).
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def _name(name: object, operation: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgument(
            f"a secret name is a letter or _ then up to 63 of [A-Za-z0-9_], not {name!r}",
            operation=operation,
        )
    return name


class AsyncSecretStore:
    """``space.secrets`` of an ``AsyncSpace``: the secrets of the key's tenant."""

    def __init__(self, api: ApiClient) -> None:
        self._api = api

    async def set(
        self,
        name: str,
        value: str,
        hosts: Sequence[str],
        *,
        env: str | None = None,
        injection: Literal["placeholder", "header"] = "placeholder",
        header: str | None = None,
        format: str = "{value}",
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
        answer = await self._api.request_json("PUT", path, operation=operation, json_body=body)
        return SecretInfo.from_wire(json_object(answer))

    async def list(self) -> builtins.list[SecretInfo]:
        """The tenant's secrets by name (metadata only). Read-only."""
        operation = "secret.list"
        answer = await self._api.request_json("GET", "/v1/secrets", operation=operation)
        return [SecretInfo.from_wire(json_object(s)) for s in listed(answer, "secrets", operation)]

    async def get(self, name: str) -> SecretInfo:
        """Secret ``name``'s metadata. Raises NotFound, InvalidArgument (malformed name).
        Read-only."""
        operation = "secret.get"
        path = f"/v1/secrets/{_name(name, operation)}"
        return SecretInfo.from_wire(
            json_object(await self._api.request_json("GET", path, operation=operation))
        )

    async def delete(self, name: str) -> None:
        """Delete secret ``name``; idempotent (a missing one is fine). Sandboxes bound to
        it stop getting it at once (their placeholders stay, and would be filled again by
        a new secret of that name). Raises InvalidArgument for a malformed name."""
        operation = "secret.delete"
        path = f"/v1/secrets/{_name(name, operation)}"
        await self._api.request_json("DELETE", path, operation=operation)


class AsyncSecrets:
    """Secrets of the key's tenant, one call per connection: every method is a
    classmethod taking ``api_url``/``api_key`` (else SPACE_API_URL / SPACE_API_KEY), and
    otherwise the same call as on ``AsyncSpace.secrets``."""

    @classmethod
    @same_contract(AsyncSecretStore.set)
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
        async with one_call(api_url, api_key, request_timeout_s, _transport) as api:
            return await AsyncSecretStore(api).set(name, value, hosts, env=env,
                injection=injection, header=header, format=format)  # fmt: skip

    @classmethod
    @same_contract(AsyncSecretStore.list)
    async def list(
        cls,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> builtins.list[SecretInfo]:
        async with one_call(api_url, api_key, request_timeout_s, _transport) as api:
            return await AsyncSecretStore(api).list()

    @classmethod
    @same_contract(AsyncSecretStore.get)
    async def get(
        cls,
        name: str,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> SecretInfo:
        async with one_call(api_url, api_key, request_timeout_s, _transport) as api:
            return await AsyncSecretStore(api).get(name)

    @classmethod
    @same_contract(AsyncSecretStore.delete)
    async def delete(
        cls,
        name: str,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        async with one_call(api_url, api_key, request_timeout_s, _transport) as api:
            await AsyncSecretStore(api).delete(name)
