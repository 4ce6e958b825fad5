"""``AsyncSpace``: one connection to the SPACE API that many calls share (issue 13).

Modelled on ``httpx.AsyncClient``: the configuration is resolved once and one pool of
connections serves every call made through ``space.sandboxes``, ``space.templates`` and
``space.secrets``, and every sandbox made there. The classmethods
(``AsyncSandbox.create(api_key=...)``...) make the same calls, each on a connection of
its own. The sync ``Space`` wraps this class.
"""

from __future__ import annotations

from types import TracebackType

import httpx

from space.sdk._http import ApiClient, ConnectionConfig
from space.sdk._sandbox import AsyncSandboxes
from space.sdk._secrets import AsyncSecretStore
from space.sdk._templates import AsyncTemplates

__all__ = ["AsyncSpace"]


class AsyncSpace:
    """A client of the SPACE API: its URL, key and timeouts, and one connection pool.

        async with AsyncSpace(api_key=key) as space:
            sbx = await space.sandboxes.create(template="base")
            print((await sbx.commands.run("echo hi")).stdout)

    ``api_url``/``api_key`` default to SPACE_API_URL / SPACE_API_KEY, then to
    http://127.0.0.1:8080 and no key; ``request_timeout_s`` bounds each ordinary request
    (default 30 s); ``ca_bundle`` (default SPACE_CA_BUNDLE) is the PEM file of the CA
    that signed an https API's certificate (``space serve --tls-cert``), None for the
    system's CAs; ``transport`` replaces the network (tests, custom networking).
    Constructing one sends nothing, so a wrong URL or key shows at the first call
    (Unavailable, AuthenticationError...).

    Sandboxes made through it share its connection: their ``close()`` leaves it open and
    ``kill()`` only deletes the sandbox. Leaving the ``async with`` block (or ``aclose``)
    closes the connection and kills no sandbox; afterwards every call through it, and
    through its sandboxes, raises Conflict.
    """

    def __init__(
        self,
        api_url: str | None = None,
        api_key: str | None = None,
        *,
        request_timeout_s: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        config = ConnectionConfig.resolve(
            api_url,
            api_key,
            request_timeout_s=request_timeout_s,
            transport=transport,
            ca_bundle=ca_bundle,
        )
        self._api = ApiClient(config)
        self.sandboxes = AsyncSandboxes(self._api)
        self.templates = AsyncTemplates(self._api)
        self.secrets = AsyncSecretStore(self._api)

    def __repr__(self) -> str:
        return f"<AsyncSpace {self.config.api_url}>"

    @property
    def config(self) -> ConnectionConfig:
        """The resolved URL, key and timeouts (frozen)."""
        return self._api.config

    async def aclose(self) -> None:
        """Close the connection pool; idempotent. Sandboxes keep running."""
        await self._api.aclose()

    async def __aenter__(self) -> AsyncSpace:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
