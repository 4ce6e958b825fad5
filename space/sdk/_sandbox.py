"""``AsyncSandbox``: the async core of the SDK. The sync ``Sandbox`` wraps it."""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import httpx

from space.sdk._commands import AsyncCommands
from space.sdk._files import AsyncFiles
from space.sdk._http import ApiClient, ConnectionConfig
from space.sdk._models import SandboxInfo
from space.sdk.errors import InternalError, NotFound

__all__ = ["AsyncSandbox"]

#: A create may boot a VM cold (seconds under TCG) or wait for a template: allow longer.
CREATE_TIMEOUT_S = 180.0


class AsyncSandbox:
    """A sandbox (one VM) and a connection to the API that manages it.

    Make one with ``await AsyncSandbox.create()`` or ``await AsyncSandbox.connect(id)``.
    ``async with`` kills the sandbox on exit; ``close()`` only drops the connection and
    leaves the sandbox running. The API URL and key come from the arguments, else from
    SPACE_API_URL / SPACE_API_KEY, else http://127.0.0.1:8080 and no key.
    """

    def __init__(self, info: SandboxInfo, api: ApiClient) -> None:
        self._info = info
        self._api = api
        self.commands = AsyncCommands(api, info.sandbox_id)
        self.files = AsyncFiles(api, info.sandbox_id)

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.sandbox_id} template={self._info.template}>"

    @property
    def sandbox_id(self) -> str:
        return self._info.sandbox_id

    @classmethod
    async def create(
        cls,
        template: str = "base",
        *,
        cpus: int = 1,
        memory_mib: int = 256,
        disk_mib: int = 2048,
        timeout_s: int | None = 300,
        env: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> AsyncSandbox:
        """Create a sandbox and return once it runs.

        ``timeout_s`` is its lifetime (None: no limit). Raises InvalidArgument (limits in
        docs/api.md), NotFound (template), ResourceExhausted (quota, no capacity),
        AuthenticationError, Unavailable, Timeout (after 180 s). A cancellation mid-way
        may leave a sandbox behind that ``list()`` shows.
        """
        api = ApiClient(_config(api_url, api_key, request_timeout_s, _transport))
        body: dict[str, Any] = {
            "template": template,
            "cpus": cpus,
            "memory_mib": memory_mib,
            "disk_mib": disk_mib,
            "timeout_s": timeout_s,
            "env": dict(env or {}),
            "metadata": dict(metadata or {}),
        }
        try:
            answer = await api.request_json(
                "POST",
                "/v1/sandboxes",
                operation="sandbox.create",
                json_body=body,
                timeout_s=CREATE_TIMEOUT_S,
            )
            return cls(SandboxInfo.from_wire(_object(answer)), api)
        except BaseException:
            await api.aclose()
            raise

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> AsyncSandbox:
        """Attach to an existing sandbox. Raises NotFound if it does not exist."""
        api = ApiClient(_config(api_url, api_key, request_timeout_s, _transport))
        try:
            info = await _get_info(api, sandbox_id)
        except BaseException:
            await api.aclose()
            raise
        return cls(info, api)

    @classmethod
    async def list(
        cls,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> builtins.list[SandboxInfo]:
        """Every sandbox of the key's tenant."""
        api = ApiClient(_config(api_url, api_key, request_timeout_s, _transport))
        try:
            body = await api.request_json("GET", "/v1/sandboxes", operation="sandbox.list")
        finally:
            await api.aclose()
        sandboxes = body.get("sandboxes") if isinstance(body, dict) else None
        if not isinstance(sandboxes, builtins.list):
            raise InternalError("malformed sandbox list", operation="sandbox.list")
        return [SandboxInfo.from_wire(_object(s)) for s in sandboxes]

    async def get_info(self) -> SandboxInfo:
        """Fresh information about this sandbox (state, expiry...). NotFound once gone."""
        self._info = await _get_info(self._api, self.sandbox_id)
        return self._info

    async def pause(self) -> SandboxInfo:
        """Pause the sandbox: its vCPUs stop, its memory and processes are kept.

        Idempotent (pausing a paused sandbox is fine). Any command or file call resumes
        it transparently; so does ``resume()``. The guest's clock stands still while
        paused. Raises Conflict (the message names the state) for a sandbox that is
        neither running nor paused, NotFound once it is gone.
        """
        return await self._transition("pause")

    async def resume(self) -> SandboxInfo:
        """Resume a paused sandbox (immediate); idempotent. Raises as ``pause()``."""
        return await self._transition("resume")

    async def _transition(self, action: str) -> SandboxInfo:
        body = await self._api.request_json(
            "POST",
            f"/v1/sandboxes/{self.sandbox_id}/{action}",
            operation=f"sandbox.{action}",
            sandbox_id=self.sandbox_id,
        )
        self._info = SandboxInfo.from_wire(_object(body))
        return self._info

    async def kill(self) -> bool:
        """Delete the sandbox and close the connection.

        Idempotent: returns False if the sandbox was already gone. Cancelling mid-way
        may leave the sandbox running; call again.
        """
        try:
            await self._api.request_json(
                "DELETE",
                f"/v1/sandboxes/{self.sandbox_id}",
                operation="sandbox.kill",
                sandbox_id=self.sandbox_id,
            )
        except NotFound:
            await self._api.aclose()
            return False
        await self._api.aclose()
        return True

    async def close(self) -> None:
        """Close the connection to the API; the sandbox keeps running. Idempotent."""
        await self._api.aclose()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.kill()


def _config(
    api_url: str | None,
    api_key: str | None,
    request_timeout_s: float | None,
    transport: httpx.AsyncBaseTransport | None,
) -> ConnectionConfig:
    return ConnectionConfig.resolve(
        api_url, api_key, request_timeout_s=request_timeout_s, transport=transport
    )


async def _get_info(api: ApiClient, sandbox_id: str) -> SandboxInfo:
    body = await api.request_json(
        "GET", f"/v1/sandboxes/{sandbox_id}", operation="sandbox.get_info", sandbox_id=sandbox_id
    )
    return SandboxInfo.from_wire(_object(body))


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InternalError("the API answered with something that is not a JSON object")
    return body
