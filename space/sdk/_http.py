"""The SDK's one HTTP client: auth, default timeouts, size limits, error translation.

Every request goes through ``ApiClient``; it turns error answers into SpaceError leaves
(via the table in errors.py) and httpx failures into Unavailable / Timeout, so nothing
from httpx crosses the SDK's public API.
"""

from __future__ import annotations

import inspect
import json
import os
import ssl
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from space.sdk.errors import (
    Conflict,
    InternalError,
    InvalidArgument,
    ResourceExhausted,
    SpaceError,
    Timeout,
    Unavailable,
    error_class,
)

__all__ = [
    "DEFAULT_API_URL",
    "ApiClient",
    "ConnectionConfig",
    "json_object",
    "listed",
    "one_call",
    "same_contract",
]

DEFAULT_API_URL = "http://127.0.0.1:8080"
#: Default bound on each ordinary request, in seconds.
DEFAULT_REQUEST_TIMEOUT_S = 30.0
#: Largest JSON answer the SDK reads into memory (a list of many sandboxes fits easily).
MAX_JSON_BYTES = 16 << 20
#: Largest error body kept for the message; the rest is noise.
_MAX_ERROR_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class ConnectionConfig:
    """Where the API is and how long to wait for it.

    ``request_timeout_s`` bounds each ordinary request (and each read of a stream: a
    stream may last longer as long as bytes keep coming); ``ca_bundle`` is a PEM file of
    the CA(s) an ``https://`` API's certificate is checked against (a server started
    with ``space serve --tls-cert``), None for the system's; ``transport`` replaces the
    network, for tests and custom networking.
    """

    api_url: str = DEFAULT_API_URL
    api_key: str | None = None
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    connect_timeout_s: float = 10.0
    ca_bundle: str | None = None
    transport: httpx.AsyncBaseTransport | None = None

    @classmethod
    def resolve(
        cls,
        api_url: str | None = None,
        api_key: str | None = None,
        *,
        request_timeout_s: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        ca_bundle: str | None = None,
    ) -> ConnectionConfig:
        """Explicit arguments win over SPACE_API_URL / SPACE_API_KEY / SPACE_CA_BUNDLE,
        then defaults."""
        return cls(
            api_url=(api_url or os.environ.get("SPACE_API_URL") or DEFAULT_API_URL).rstrip("/"),
            api_key=api_key or os.environ.get("SPACE_API_KEY") or None,
            request_timeout_s=request_timeout_s or DEFAULT_REQUEST_TIMEOUT_S,
            ca_bundle=ca_bundle or os.environ.get("SPACE_CA_BUNDLE") or None,
            transport=transport,
        )


class ApiClient:
    """An httpx.AsyncClient bound to one ConnectionConfig. Close it with ``aclose``."""

    def __init__(self, config: ConnectionConfig) -> None:
        """Raises InvalidArgument if ``config.ca_bundle`` cannot be read as PEM CAs."""
        self.config = config
        headers = {"User-Agent": "space-sdk/0.1"}
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        self._client = httpx.AsyncClient(
            base_url=config.api_url,
            headers=headers,
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            transport=config.transport,
            verify=_verify(config.ca_bundle),
        )

    async def aclose(self) -> None:
        """Close the connection pool; idempotent."""
        await self._client.aclose()

    async def request_json(
        self,
        method: str,
        path: str,
        *,
        operation: str,
        sandbox_id: str | None = None,
        json_body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        headers: Mapping[str, str] | None = None,
        content: bytes | None = None,
    ) -> Any:
        """Send a request and return its JSON answer (None for an empty answer).

        ``content`` is a raw body, sent instead of ``json_body``.

        Raises a SpaceError leaf for an error answer, ResourceExhausted if the answer is
        larger than MAX_JSON_BYTES, InternalError if it is not JSON.
        """
        async with self.stream(
            method,
            path,
            operation=operation,
            sandbox_id=sandbox_id,
            json_body=json_body,
            params=params,
            timeout_s=timeout_s,
            headers=headers,
            content=content,
        ) as response:
            body = await read_capped(response, MAX_JSON_BYTES, operation=operation)
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError:
            raise InternalError(
                "the API answered with something that is not JSON",
                operation=operation,
                sandbox_id=sandbox_id,
                status_code=response.status_code,
            ) from None

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        *,
        operation: str,
        sandbox_id: str | None = None,
        json_body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        content: AsyncIterator[bytes] | bytes | None = None,
        timeout_s: float | None = None,
        read_timeout_s: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """Open a request whose successful answer is read by the caller, then closed.

        ``timeout_s`` overrides the per-operation timeout; ``read_timeout_s`` (when given)
        the wait for each next chunk of a long stream. Error answers raise before the
        caller sees them. Leaving the block early closes the connection: for an exec,
        the server then kills a foreground process. ``headers`` are added to the
        connection's own.
        """
        base = timeout_s or self.config.request_timeout_s
        timeout = httpx.Timeout(
            base, connect=self.config.connect_timeout_s, read=read_timeout_s or base
        )
        if self._client.is_closed:
            raise Conflict(
                "this connection is closed (its sandbox or AsyncSpace was killed or closed)",
                operation=operation,
                sandbox_id=sandbox_id,
            )
        with translate_errors(operation=operation, sandbox_id=sandbox_id):
            request = self._client.build_request(
                method,
                path,
                json=json_body,
                params=params,
                content=content,
                timeout=timeout,
                headers=headers,
            )
            response = await self._client.send(request, stream=True)
            try:
                if response.status_code >= 400:
                    raise await _error_from(response, operation=operation, sandbox_id=sandbox_id)
                yield response
            finally:
                await response.aclose()


@asynccontextmanager
async def one_call(
    api_url: str | None,
    api_key: str | None,
    request_timeout_s: float | None,
    transport: httpx.AsyncBaseTransport | None,
    *,
    keep_open: bool = False,
) -> AsyncIterator[ApiClient]:
    """The connection of one classmethod call (``AsyncSandbox.list(api_key=...)``...).

    Made from its arguments, else SPACE_API_URL / SPACE_API_KEY, then defaults. Closed
    when the block ends, or with ``keep_open`` only when it raises: a sandbox the call
    made keeps the connection and closes it itself.
    """
    api = ApiClient(
        ConnectionConfig.resolve(
            api_url, api_key, request_timeout_s=request_timeout_s, transport=transport
        )
    )
    try:
        yield api
    except BaseException:
        await api.aclose()
        raise
    if not keep_open:
        await api.aclose()


_F = TypeVar("_F", bound=Callable[..., Any])


def _verify(ca_bundle: str | None) -> ssl.SSLContext | bool:
    # An SSLContext, not httpx's deprecated verify=<path>; the system's CAs without one.
    if ca_bundle is None:
        return True
    try:
        return ssl.create_default_context(cafile=ca_bundle)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgument(f"CA bundle {ca_bundle}: {exc}") from None


def same_contract(core: Callable[..., Any]) -> Callable[[_F], _F]:
    """Give a connection-taking classmethod the docstring of the ``AsyncSpace`` call it
    wraps, so the contract is written once."""

    def document(function: _F) -> _F:
        function.__doc__ = (
            f"{inspect.cleandoc(core.__doc__ or '')}\n\n"
            "The connection is this call's own: ``api_url``/``api_key``, else SPACE_API_URL"
            " / SPACE_API_KEY. ``AsyncSpace`` shares one connection across calls."
        )
        return function

    return document


def listed(body: Any, key: str, operation: str) -> list[Any]:
    """``body[key]`` of a ``{key: [...]}`` answer; InternalError for any other shape."""
    items = body.get(key) if isinstance(body, dict) else None
    if not isinstance(items, list):
        raise InternalError(f"malformed answer: no {key} list", operation=operation)
    return items


def json_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InternalError("the API answered with something that is not a JSON object")
    return body


@contextmanager
def translate_errors(*, operation: str, sandbox_id: str | None) -> Iterator[None]:
    """Turn httpx failures inside the block into SpaceError leaves."""
    context: dict[str, Any] = {"operation": operation, "sandbox_id": sandbox_id}
    try:
        yield
    except httpx.TimeoutException as exc:
        raise Timeout(f"the API did not answer in time: {_describe(exc)}", **context) from exc
    except httpx.TransportError as exc:
        if isinstance(exc, httpx.UnsupportedProtocol):
            raise InvalidArgument(f"bad API URL: {_describe(exc)}", **context) from exc
        raise Unavailable(f"cannot reach the API: {_describe(exc)}", **context) from exc
    except httpx.InvalidURL as exc:
        raise InvalidArgument(f"bad API URL: {_describe(exc)}", **context) from exc
    except (httpx.HTTPError, httpx.StreamError) as exc:
        raise InternalError(f"HTTP client failure: {_describe(exc)}", **context) from exc


async def read_capped(response: httpx.Response, limit: int, *, operation: str) -> bytes:
    """Read a whole answer body, refusing more than ``limit`` bytes."""
    chunks = bytearray()
    async for chunk in response.aiter_bytes():
        chunks += chunk
        if len(chunks) > limit:
            raise ResourceExhausted(
                f"answer is larger than the {limit}-byte limit",
                operation=operation,
                details={"limit_bytes": limit, "observed_bytes": len(chunks)},
            )
    return bytes(chunks)


async def _error_from(
    response: httpx.Response, *, operation: str, sandbox_id: str | None
) -> SpaceError:
    raw = bytearray()
    async for chunk in response.aiter_bytes():
        raw += chunk
        if len(raw) > _MAX_ERROR_BYTES:
            break
    code, message, details = _parse_error_body(bytes(raw[:_MAX_ERROR_BYTES]))
    cls = error_class(code=code, status_code=response.status_code)
    return cls(
        message or f"HTTP {response.status_code} {response.reason_phrase}",
        operation=operation,
        sandbox_id=sandbox_id,
        status_code=response.status_code,
        details=details,
    )


def _parse_error_body(raw: bytes) -> tuple[str | None, str, dict[str, Any]]:
    """(code, message, details) from ``{"error": {...}}``, tolerating other shapes."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None, raw.decode("utf-8", "replace").strip()[:500], {}
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        details = error.get("details")
        return (
            str(error["code"]) if "code" in error else None,
            str(error.get("message", "")),
            details if isinstance(details, dict) else {},
        )
    if isinstance(body, dict) and "detail" in body:  # a framework-made error answer
        return None, str(body["detail"])[:500], {}
    return None, str(body)[:500], {}


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
