"""E2B's in-sandbox daemon (envd, port 49983) served by the control plane (issue 20).

The E2B SDK talks to envd in the sandbox; we have no envd: space.control.sandbox_traffic
hands each request addressed to port 49983 of a sandbox to ``EnvdHandler``, which
authenticates it (``X-Access-Token``: the sandbox's ENVD token), resumes a paused or
hibernated sandbox (as every guest operation of the API does) and translates it to
our guest operations on the sandbox's node:

- ``/process.Process/*`` (space.control.e2b.envd_process) and
  ``/filesystem.Filesystem/*`` (space.control.e2b.envd_filesystem): Connect RPCs,
  JSON codec (space.control.e2b.connect);
- ``GET /health``, ``GET /files`` (download, streamed), ``POST /files`` (upload,
  streamed: octet-stream or multipart) (space.control.e2b.envd_files).

The user an operation runs as is E2B's ``Authorization: Basic base64(<user>:)``
(default ``user``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from space.control import sandbox_traffic
from space.control.access_tokens import TokenPurpose, check_token
from space.control.deps import ControlContext, live_sandbox
from space.control.e2b import envd_files
from space.control.e2b.connect import (
    CONNECT_JSON,
    UNARY_JSON,
    Code,
    ConnectError,
    Fields,
    connect_error_of,
    end_stream,
    envelope,
    parse_message,
    read_body,
    read_envelopes,
    send_unary,
    send_unary_error,
    stream_start,
    timeout_of,
)
from space.control.e2b.envd_filesystem import KEEPALIVE as WATCH_KEEPALIVE
from space.control.e2b.envd_filesystem import FilesystemService, Watchers
from space.control.e2b.envd_process import KEEPALIVE as PROCESS_KEEPALIVE
from space.control.e2b.envd_process import ProcessService
from space.control.e2b.envd_request import not_running_message, user_of
from space.control.errors import ApiError
from space.control.store.repo import SandboxRecord
from space.node.api.errors import NodeError

__all__ = ["EnvdHandler", "with_keepalives"]

log = logging.getLogger(__name__)

#: Keepalive messages on an idle stream: the SDK asks for one every
#: ``Keepalive-Ping-Interval`` seconds (50); we keep to 1..300.
_KEEPALIVE_BOUNDS_S = (1.0, 300.0)


class _Kind(enum.Enum):
    """How an RPC's messages flow (Connect: unary, server or client streaming)."""

    UNARY = "unary"
    SERVER = "server"
    CLIENT = "client"


@dataclass(frozen=True)
class _Rpc:
    kind: _Kind
    service: str
    method: str
    #: What a Conflict from the node is to the client, where it is not a state.
    conflict: Code | None = None


_RPCS: dict[str, _Rpc] = {
    "/process.Process/Start": _Rpc(_Kind.SERVER, "process", "start"),
    "/process.Process/Connect": _Rpc(_Kind.SERVER, "process", "connect"),
    "/process.Process/List": _Rpc(_Kind.UNARY, "process", "list"),
    "/process.Process/SendInput": _Rpc(_Kind.UNARY, "process", "send_input"),
    "/process.Process/StreamInput": _Rpc(_Kind.CLIENT, "process", "stream_input"),
    "/process.Process/CloseStdin": _Rpc(_Kind.UNARY, "process", "close_stdin"),
    "/process.Process/SendSignal": _Rpc(_Kind.UNARY, "process", "send_signal"),
    "/process.Process/Update": _Rpc(_Kind.UNARY, "process", "update"),
    "/filesystem.Filesystem/Stat": _Rpc(_Kind.UNARY, "filesystem", "stat"),
    "/filesystem.Filesystem/ListDir": _Rpc(_Kind.UNARY, "filesystem", "list_dir"),
    "/filesystem.Filesystem/MakeDir": _Rpc(
        _Kind.UNARY, "filesystem", "make_dir", Code.ALREADY_EXISTS
    ),
    "/filesystem.Filesystem/Move": _Rpc(_Kind.UNARY, "filesystem", "move", Code.ALREADY_EXISTS),
    "/filesystem.Filesystem/Remove": _Rpc(_Kind.UNARY, "filesystem", "remove"),
    "/filesystem.Filesystem/WatchDir": _Rpc(_Kind.SERVER, "filesystem", "watch_dir"),
    "/filesystem.Filesystem/CreateWatcher": _Rpc(_Kind.UNARY, "filesystem", "create_watcher"),
    "/filesystem.Filesystem/GetWatcherEvents": _Rpc(
        _Kind.UNARY, "filesystem", "get_watcher_events"
    ),
    "/filesystem.Filesystem/RemoveWatcher": _Rpc(_Kind.UNARY, "filesystem", "remove_watcher"),
}


def _keepalive_s(headers: Headers) -> float | None:
    text = headers.get("keepalive-ping-interval", "")
    if not re.fullmatch(r"[0-9]{1,6}", text):
        return None
    low, high = _KEEPALIVE_BOUNDS_S
    return min(max(float(text), low), high)


class EnvdHandler:
    """The ``envd`` SandboxHandler of space.control.sandbox_traffic. Holds this
    replica's non-streaming watchers."""

    def __init__(self) -> None:
        self.watchers = Watchers()

    async def __call__(
        self,
        ctx: ControlContext,
        record: SandboxRecord,
        port: int,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        headers = Headers(scope=scope)
        given = headers.get("x-access-token")
        if scope["type"] != "http" or not check_token(
            ctx.node_token, record.id, TokenPurpose.ENVD, given
        ):
            message = sandbox_traffic.UNAUTHORIZED_MESSAGE
            await sandbox_traffic.refuse(scope, receive, send, 401, message)
            return
        path: str = scope["path"]
        rpc = _RPCS.get(path)
        if rpc is not None:
            await self._rpc(ctx, record, rpc, headers, scope, receive, send)
            return
        await envd_files.serve(ctx, record, scope, receive, send, _live(ctx))

    async def _rpc(
        self,
        ctx: ControlContext,
        record: SandboxRecord,
        rpc: _Rpc,
        headers: Headers,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        streaming = rpc.kind != _Kind.UNARY
        if scope["method"] != "POST" or content_type != (CONNECT_JSON if streaming else UNARY_JSON):
            error = ConnectError(
                Code.UNIMPLEMENTED,
                f"{rpc.method} takes POST with {CONNECT_JSON if streaming else UNARY_JSON}",
            )
            await send_unary_error(send, error)
            return
        try:
            record = await _live(ctx)(record)
            handler = self._service(ctx, record, rpc, headers)
        except ConnectError as error:
            await (_stream_error(send, error) if streaming else send_unary_error(send, error))
            return
        if rpc.kind == _Kind.UNARY:
            await _serve_unary(handler, rpc, receive, send)
        elif rpc.kind == _Kind.CLIENT:
            await _serve_client_stream(handler, rpc, receive, send)
        else:
            await self._server_stream(ctx, record, handler, rpc, headers, scope, receive, send)

    async def _server_stream(
        self,
        ctx: ControlContext,
        record: SandboxRecord,
        handler: Callable[..., Any],
        rpc: _Rpc,
        headers: Headers,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        try:
            request = await _one_envelope(receive)
        except ConnectError as error:
            await _stream_error(send, error)
            return
        keepalive = PROCESS_KEEPALIVE if rpc.service == "process" else WATCH_KEEPALIVE
        messages = _server_messages(handler(request), rpc, keepalive, _keepalive_s(headers))
        # StreamingResponse ends the stream (closing ``messages``) when the client goes.
        response = StreamingResponse(
            ctx.activity.watch(record.id, messages), media_type=CONNECT_JSON
        )
        await response(scope, receive, send)

    def _service(
        self, ctx: ControlContext, record: SandboxRecord, rpc: _Rpc, headers: Headers
    ) -> Callable[..., Any]:
        node = ctx.nodes.get(record.node_id)
        user = user_of(headers)
        service: ProcessService | FilesystemService
        if rpc.service == "process":
            service = ProcessService(node, record.id, user, timeout_of(headers))
        else:
            service = FilesystemService(node, record.id, user, self.watchers, _spawner(ctx))
        method: Callable[..., Any] = getattr(service, rpc.method)
        return method


def _spawner(ctx: ControlContext) -> Callable[[Any], asyncio.Task[None]]:
    """Runs a coroutine as one of the app's tasks (cancelled when the app stops)."""

    def spawn(coroutine: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coroutine)
        ctx.tasks.add(task)
        task.add_done_callback(ctx.tasks.discard)
        return task

    return spawn


def _live(ctx: ControlContext) -> Callable[[SandboxRecord], Awaitable[SandboxRecord]]:
    """deps.live_sandbox with its ApiError as a ConnectError."""

    async def live(record: SandboxRecord) -> SandboxRecord:
        try:
            return await live_sandbox(ctx, record)
        except (ApiError, NodeError) as exc:
            error = connect_error_of(exc)
            if isinstance(exc, ApiError) and exc.code == "conflict":
                error = ConnectError(Code.UNAVAILABLE, not_running_message(record))
            raise error from None

    return live


def _error_of(exc: Exception, rpc: _Rpc) -> ConnectError:
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, (NodeError, ApiError)):
        return connect_error_of(exc, conflict=rpc.conflict)
    log.exception("envd %s failed", rpc.method, exc_info=exc)
    return ConnectError(Code.INTERNAL, f"{rpc.method} failed: {type(exc).__name__}")


async def _serve_unary(
    handler: Callable[..., Any], rpc: _Rpc, receive: Receive, send: Send
) -> None:
    try:
        request = Fields(parse_message(await read_body(receive) or b"{}"))
        answer = await handler(request)
    except Exception as exc:
        await send_unary_error(send, _error_of(exc, rpc))
        return
    await send_unary(send, answer)


async def _serve_client_stream(
    handler: Callable[..., Any], rpc: _Rpc, receive: Receive, send: Send
) -> None:
    async def messages() -> AsyncIterator[Fields]:
        async for message in read_envelopes(receive):
            yield Fields(message)

    try:
        answer = await handler(messages())
    except Exception as exc:
        await _stream_error(send, _error_of(exc, rpc))
        return
    await send(stream_start())
    await send({"type": "http.response.body", "body": envelope(answer), "more_body": True})
    await send({"type": "http.response.body", "body": end_stream(None)})


async def _stream_error(send: Send, error: ConnectError) -> None:
    await send(stream_start())
    await send({"type": "http.response.body", "body": end_stream(error)})


async def _server_messages(
    messages: AsyncIterator[dict[str, Any]],
    rpc: _Rpc,
    keepalive: dict[str, Any],
    keepalive_s: float | None,
) -> AsyncIterator[bytes]:
    """The stream's envelopes: its messages, a keepalive after each idle
    ``keepalive_s``, then the end-stream envelope (carrying the error, if any).
    Closing it closes ``messages`` (with_keepalives owns them)."""
    error: ConnectError | None = None
    try:
        async for message in with_keepalives(messages, keepalive, keepalive_s):
            yield envelope(message)
    except Exception as exc:
        error = _error_of(exc, rpc)
    yield end_stream(error)


async def _one_envelope(receive: Receive) -> Fields:
    found: Fields | None = None
    async for message in read_envelopes(receive):
        if found is not None:
            raise ConnectError(Code.INVALID_ARGUMENT, "a server stream takes one message")
        found = Fields(message)
    if found is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "the request has no message")
    return found


async def with_keepalives(
    messages: AsyncIterator[dict[str, Any]], keepalive: dict[str, Any], interval_s: float | None
) -> AsyncIterator[dict[str, Any]]:
    """``messages``, with ``keepalive`` after each ``interval_s`` without one (None:
    never). Owns ``messages``: closing the result closes it.

    With keepalives, ``messages`` is driven by a task of its own feeding a one-slot
    queue, so that waiting on it can time out without cancelling it mid-step; closing
    the result cancels that task, which closes ``messages`` itself (a request's cancel
    scope, which cancels every await of the request, never reaches it).
    """
    if interval_s is None:
        try:
            async for message in messages:
                yield message
        finally:
            await messages.aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=1)
    producer = asyncio.get_running_loop().create_task(_produce(messages, queue))
    _PRODUCERS.add(producer)
    producer.add_done_callback(_PRODUCERS.discard)
    try:
        while True:
            try:
                async with asyncio.timeout(interval_s):
                    kind, value = await queue.get()
            except TimeoutError:
                yield keepalive
                continue
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        producer.cancel()


#: The tasks driving streams with keepalives (a reference keeps each alive).
_PRODUCERS: set[asyncio.Task[None]] = set()


async def _produce(
    messages: AsyncIterator[dict[str, Any]], queue: asyncio.Queue[tuple[str, Any]]
) -> None:
    try:
        async for message in messages:
            await queue.put(("message", message))
        await queue.put(("end", None))
    except Exception as exc:
        await queue.put(("error", exc))
    finally:
        await messages.aclose()  # type: ignore[attr-defined]
