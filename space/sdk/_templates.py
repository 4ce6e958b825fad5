"""``AsyncTemplates`` (``space.templates``): build, list and delete templates; the
classmethods of ``AsyncTemplate`` make the same calls on a connection of their own. The
sync ``Template`` wraps them."""

from __future__ import annotations

import asyncio
import builtins
import re
from collections.abc import Callable
from os import PathLike
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from space.sdk._events import iter_events
from space.sdk._http import ApiClient, json_object, listed, one_call, same_contract
from space.sdk._models import TemplateInfo
from space.sdk._pack import SPEC_NAME, plan_context, stream_context
from space.sdk.errors import BuildError, InternalError, InvalidArgument

__all__ = ["BUILD_TIMEOUT_S", "AsyncTemplate", "AsyncTemplates", "LogCallback"]

#: A build installs packages and runs commands in a VM: allow it an hour, and half an
#: hour of silence (one long step) between two log lines.
BUILD_TIMEOUT_S = 3600.0
BUILD_SILENCE_S = 1800.0
_REF = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}(:[a-z0-9][a-z0-9_.-]{0,63}|@[0-9a-f]{64})?$")

#: Receives each line of a build's log; its return value is ignored.
LogCallback = Callable[[str], object]


class AsyncTemplates:
    """``space.templates`` of an ``AsyncSpace``: build, list and delete templates of the
    key's tenant (``base``, shared and read-only, and its own builds)."""

    def __init__(self, api: ApiClient) -> None:
        self._api = api

    async def build(
        self,
        path: str | PathLike[str],
        *,
        spec: str = SPEC_NAME,
        on_log: LogCallback | None = None,
    ) -> TemplateInfo:
        """Build the template that ``path/spec`` describes, from the files under ``path``.

        The directory is sent as a gzip'd tar (the spec as ``space.toml``), never read
        whole into memory; ``on_log`` gets each log line as the build goes. Returns the
        new build, which the spec's ``name:tag`` now names. Raises InvalidArgument (a
        symlink pointing outside ``path``, a special file, a bad spec: nothing is built),
        Conflict (the name ``base``), NotFound (a base template), ResourceExhausted (the
        1 GiB upload limit), BuildError (a step failed: ``step`` and ``message``; the tag
        still names its previous build), Timeout (after BUILD_TIMEOUT_S). A cancellation
        stops listening; the build carries on to its end on the server.
        """
        entries = await asyncio.to_thread(plan_context, Path(path), spec)
        async with self._api.stream(
            "POST",
            "/v1/templates",
            operation="template.build",
            content=stream_context(entries),
            timeout_s=BUILD_TIMEOUT_S,
            read_timeout_s=BUILD_SILENCE_S,
        ) as response:
            return await _follow(response, on_log)

    async def list(self) -> builtins.list[TemplateInfo]:
        """``base`` and the tenant's templates, one per name and tag, sorted. Read-only."""
        body = await self._api.request_json("GET", "/v1/templates", operation="template.list")
        items = listed(body, "templates", operation="template.list")
        return [TemplateInfo.from_wire(json_object(item)) for item in items]

    async def delete(self, ref: str | TemplateInfo) -> None:
        """Delete ``name`` / ``name:tag`` (that tag) or ``name@digest`` (every tag of it).

        Sandboxes made from it are unaffected. Not idempotent: NotFound once it is gone.
        Raises InvalidArgument for a malformed reference (nothing is sent), Conflict for
        ``base``.
        """
        text = ref.ref if isinstance(ref, TemplateInfo) else ref
        if not isinstance(text, str) or not _REF.match(text):
            raise InvalidArgument(
                f"not a template reference: {text!r}", operation="template.delete"
            )
        await self._api.request_json(
            "DELETE", f"/v1/templates/{quote(text, safe=':@')}", operation="template.delete"
        )


class AsyncTemplate:
    """Templates of the key's tenant, one call per connection: every method is a
    classmethod taking ``api_url``/``api_key`` (else SPACE_API_URL / SPACE_API_KEY), and
    otherwise the same call as on ``AsyncSpace.templates``."""

    @classmethod
    @same_contract(AsyncTemplates.build)
    async def build(
        cls,
        path: str | PathLike[str],
        *,
        spec: str = SPEC_NAME,
        on_log: LogCallback | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> TemplateInfo:
        async with one_call(api_url, api_key, request_timeout_s, _transport) as api:
            return await AsyncTemplates(api).build(path, spec=spec, on_log=on_log)

    @classmethod
    @same_contract(AsyncTemplates.list)
    async def list(
        cls,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> builtins.list[TemplateInfo]:
        async with one_call(api_url, api_key, request_timeout_s, _transport) as api:
            return await AsyncTemplates(api).list()

    @classmethod
    @same_contract(AsyncTemplates.delete)
    async def delete(
        cls,
        ref: str | TemplateInfo,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        async with one_call(api_url, api_key, request_timeout_s, _transport) as api:
            await AsyncTemplates(api).delete(ref)


async def _follow(response: httpx.Response, on_log: LogCallback | None) -> TemplateInfo:
    """Read a build's NDJSON: log lines to ``on_log``, then the template or the error."""
    async for event in iter_events(response):
        kind = event.get("type")
        if kind == "log" and on_log is not None:
            on_log(str(event.get("line", "")))
        elif kind == "template":
            return TemplateInfo.from_wire(_mapping(event.get("template")))
        elif kind == "error":
            raise _build_error(event)
    raise InternalError("the build stream ended without a result", operation="template.build")


def _build_error(event: dict[str, Any]) -> BuildError:
    step = event.get("step")
    return BuildError(
        str(event.get("message", "build failed")),
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        error_code=str(event.get("code", "internal")),
    )


def _mapping(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InternalError("malformed template in answer", operation="template.build")
    return value
