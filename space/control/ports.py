"""Port exposure (issue 20): servers listening in a sandbox, reached through SPACE.

A request that addresses port P of a sandbox (space.control.sandbox_traffic: the Host
``P-<id>.<sandbox_domain>`` or the ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers) is
served here: HTTP is forwarded as HTTP/1.1 and its answer streamed back; a WebSocket is
opened to the server in turn and messages relayed both ways. The bytes travel over a
NodeService.open_port tunnel: spaced connects to 127.0.0.1:P (else ::1) inside the
guest, so the control plane and node never enter the sandbox's network namespace.

Who may: a per-sandbox setting, ``ports`` on its row (off by default):

- ``off``: every request is refused, 403;
- ``token``: the request carries the sandbox's traffic token
  (space.control.access_tokens) as ``X-Space-Traffic-Token`` or
  ``e2b-traffic-access-token`` (E2B's header); missing or wrong: 401;
- ``public``: anyone who knows the address.

A request for no sandbox (or a deleted one) is answered as a wrong token (401), so ids
cannot be probed. A paused or hibernated sandbox is resumed first (deps.live_sandbox,
within its tenant's quotas). Bounds: MAX_TUNNELS_PER_SANDBOX and MAX_TUNNELS_PER_TENANT
connections at once per control-plane replica (429 past them), a request body of at
most MAX_REQUEST_BODY_BYTES (413), WebSocket messages of at most
websocket.MAX_MESSAGE_BYTES. Nothing listening on the port is 502.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import replace

import h11
from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

from space.control import deps
from space.control.access_tokens import TokenPurpose, check_token, sandbox_token
from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.sandbox_traffic import UNAUTHORIZED_MESSAGE, refuse
from space.control.schemas import PortsBody, PortsOut
from space.control.store import repo
from space.control.store.repo import SandboxRecord
from space.node.api import STATUS_BY_CODE, ConnectionRefused, NodeError, PortTunnel
from space.node.api.websocket_client import WebSocketClient, WebSocketError

__all__ = [
    "MAX_REQUEST_BODY_BYTES",
    "MAX_TUNNELS_PER_SANDBOX",
    "MAX_TUNNELS_PER_TENANT",
    "PORTS_OFF",
    "PORTS_PUBLIC",
    "PORTS_TOKEN",
    "TOKEN_HEADERS",
    "PortProxy",
    "mode_of",
    "ports_out",
    "set_ports",
]

PORTS_OFF = "off"
PORTS_TOKEN = "token"
PORTS_PUBLIC = "public"
#: Where a request may carry the traffic token: ours, and E2B's (what its SDK documents).
TOKEN_HEADERS = ("x-space-traffic-token", "e2b-traffic-access-token")
#: Connections to one sandbox's ports at once (the guest allows 256 for all uses).
MAX_TUNNELS_PER_SANDBOX = 64
#: Connections to all of one tenant's sandboxes at once.
MAX_TUNNELS_PER_TENANT = 256
#: Largest request body forwarded (declared or streamed).
MAX_REQUEST_BODY_BYTES = 64 * 1024 * 1024
#: Largest response head a server in a sandbox may send.
MAX_RESPONSE_HEAD_BYTES = 64 * 1024

# Hop-by-hop headers (RFC 9110 7.6.1) and ours: never forwarded either way.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# The envd token too: e2b-code-interpreter sends it with every request to its port, and
# it opens the sandbox's own control (space.control.e2b) to whoever holds it.
_OURS = frozenset(
    {
        b"e2b-sandbox-id",
        b"e2b-sandbox-port",
        b"x-access-token",
        *(h.encode() for h in TOKEN_HEADERS),
    }
)
# Handshake headers the WebSocket client makes itself.
_WS_OWN = frozenset(
    {
        b"host",
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-extensions",
        b"sec-websocket-protocol",
    }
)


def mode_of(body: PortsBody) -> str:
    if not body.enabled:
        return PORTS_OFF
    return PORTS_PUBLIC if body.public else PORTS_TOKEN


def ports_out(ctx: ControlContext, record: SandboxRecord) -> PortsOut:
    """What the sandbox's tenant is told (never anyone else: the token opens it)."""
    token = None
    if record.ports == PORTS_TOKEN:
        token = sandbox_token(ctx.node_token, record.id, TokenPurpose.TRAFFIC)
    return PortsOut(
        enabled=record.ports != PORTS_OFF,
        public=record.ports == PORTS_PUBLIC,
        domain=ctx.settings.sandbox_domain or None,
        traffic_token=token,
    )


async def set_ports(ctx: ControlContext, record: SandboxRecord, body: PortsBody) -> SandboxRecord:
    """Change who may reach the sandbox's ports, from the next request on (connections
    already open stay). Idempotent."""
    mode = mode_of(body)
    await ctx.db.run(lambda s: repo.set_ports(s, record.id, mode))
    return replace(record, ports=mode)


class _Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class PortProxy:
    """The ``ports`` handler of SandboxTraffic (one per app: it counts open tunnels)."""

    def __init__(
        self,
        *,
        per_sandbox: int = MAX_TUNNELS_PER_SANDBOX,
        per_tenant: int = MAX_TUNNELS_PER_TENANT,
        max_body_bytes: int = MAX_REQUEST_BODY_BYTES,
    ) -> None:
        self.per_sandbox = per_sandbox
        self.per_tenant = per_tenant
        self.max_body_bytes = max_body_bytes
        self.open_by_sandbox: Counter[str] = Counter()
        self.open_by_tenant: Counter[str] = Counter()

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
        try:
            _authorize(ctx, record, headers)
            self._check_body(scope, headers)
            with self._counted(record):
                tunnel = await self._open(ctx, record, port)
                try:
                    if scope["type"] == "websocket":
                        await _proxy_websocket(scope, receive, send, tunnel)
                    else:
                        await _proxy_http(scope, receive, send, tunnel, self.max_body_bytes)
                finally:
                    await tunnel.aclose()
        except _Refusal as exc:
            await refuse(scope, receive, send, exc.status, exc.message)

    def _check_body(self, scope: Scope, headers: Headers) -> None:
        declared = headers.get("content-length", "")
        if scope["type"] == "http" and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _Refusal(413, f"request body over the {self.max_body_bytes}-byte limit")

    @contextlib.contextmanager
    def _counted(self, record: SandboxRecord) -> Iterator[None]:
        if self.open_by_sandbox[record.id] >= self.per_sandbox:
            raise _Refusal(429, f"{self.per_sandbox} connections to sandbox {record.id} open")
        if self.open_by_tenant[record.tenant_id] >= self.per_tenant:
            raise _Refusal(429, f"{self.per_tenant} connections to the tenant's sandboxes open")
        self.open_by_sandbox[record.id] += 1
        self.open_by_tenant[record.tenant_id] += 1
        try:
            yield
        finally:
            for counter, key in (
                (self.open_by_sandbox, record.id),
                (self.open_by_tenant, record.tenant_id),
            ):
                counter[key] -= 1
                if not counter[key]:
                    del counter[key]

    async def _open(self, ctx: ControlContext, record: SandboxRecord, port: int) -> PortTunnel:
        try:
            live = await deps.live_sandbox(ctx, record)
            return await ctx.nodes.get(live.node_id).open_port(live.id, port)
        except ApiError as exc:
            raise _Refusal(STATUS_BY_CODE.get(exc.code, 502), exc.message) from None
        except ConnectionRefused:
            raise _Refusal(
                502, f"sandbox {record.id} is running but nothing listens on port {port}"
            ) from None
        except NodeError as exc:
            raise _Refusal(502, f"port {port} of sandbox {record.id}: {exc.message}") from None


def _authorize(ctx: ControlContext, record: SandboxRecord, headers: Headers) -> None:
    # A deleted sandbox never gets here: space.control.sandbox_traffic answers it 401.
    if record.ports == PORTS_PUBLIC:
        return
    if record.ports == PORTS_TOKEN:
        for name in TOKEN_HEADERS:
            if check_token(ctx.node_token, record.id, TokenPurpose.TRAFFIC, headers.get(name)):
                return
        raise _Refusal(401, UNAUTHORIZED_MESSAGE)
    raise _Refusal(403, f"sandbox {record.id} exposes no ports (enable them: docs/api.md Ports)")


def _forwarded(
    raw: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes]
) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw if k.lower() not in _HOP_BY_HOP | _OURS | drop]


# -- HTTP --------------------------------------------------------------------------


class _ClientGone(Exception):
    pass


async def _proxy_http(
    scope: Scope, receive: Receive, send: Send, tunnel: PortTunnel, max_body_bytes: int
) -> None:
    headers = Headers(scope=scope)
    out = _forwarded(scope["headers"], frozenset())
    has_length = "content-length" in headers
    chunked = not has_length and "transfer-encoding" in headers
    if chunked:
        out.append((b"transfer-encoding", b"chunked"))
    out.append((b"connection", b"close"))  # one request per tunnel
    target = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_RESPONSE_HEAD_BYTES)
    await _send_h11(tunnel, conn, h11.Request(method=scope["method"], target=target, headers=out))
    started = False

    async def download() -> None:
        nonlocal started
        async for event in _response_events(conn, tunnel):
            if isinstance(event, h11.Response):
                started = True
                response_headers = _forwarded(event.headers, frozenset())
                await send(
                    {
                        "type": "http.response.start",
                        "status": event.status_code,
                        "headers": response_headers,
                    }
                )
            elif isinstance(event, h11.Data):
                await send(
                    {"type": "http.response.body", "body": bytes(event.data), "more_body": True}
                )
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    try:
        async with asyncio.TaskGroup() as tasks:
            upload = tasks.create_task(
                _upload(receive, tunnel, conn, has_length or chunked, max_body_bytes)
            )
            await download()
            upload.cancel()  # answered: the rest of the body (if any) no longer matters
    except* _ClientGone:
        pass
    except* (NodeError, h11.ProtocolError, _Refusal) as group:
        if not started:
            exc = group.exceptions[0]
            status = exc.status if isinstance(exc, _Refusal) else 502
            message = exc.message if isinstance(exc, _Refusal | NodeError) else str(exc)
            await refuse(
                scope, receive, send, status, f"the server in the sandbox failed: {message}"
            )


async def _upload(
    receive: Receive, tunnel: PortTunnel, conn: h11.Connection, has_body: bool, max_body_bytes: int
) -> None:
    """The request body to the server, then wait for the client to leave."""
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        body = message.get("body", b"")
        more = message.get("more_body", False)
        size += len(body)
        if size > max_body_bytes:
            raise _Refusal(413, f"request body over the {max_body_bytes}-byte limit")
        if body and has_body:
            await _send_h11(tunnel, conn, h11.Data(data=body))
    await _send_h11(tunnel, conn, h11.EndOfMessage())
    while (await receive())["type"] != "http.disconnect":
        pass
    raise _ClientGone


async def _send_h11(tunnel: PortTunnel, conn: h11.Connection, event: h11.Event) -> None:
    data = conn.send(event)
    if data:
        await tunnel.write(data)


async def _response_events(conn: h11.Connection, tunnel: PortTunnel) -> AsyncIterator[h11.Event]:
    """The server's response events until its end (h11.EndOfMessage, not yielded)."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await tunnel.read())
            continue
        if isinstance(event, h11.EndOfMessage):
            return
        if isinstance(event, h11.ConnectionClosed):
            raise h11.RemoteProtocolError("the server closed the connection mid-response")
        if isinstance(event, h11.InformationalResponse):
            continue  # 100 Continue and the like: ASGI has no place for them
        assert isinstance(event, h11.Response | h11.Data)
        yield event


# -- WebSocket ---------------------------------------------------------------------


async def _proxy_websocket(scope: Scope, receive: Receive, send: Send, tunnel: PortTunnel) -> None:
    first = await receive()
    if first["type"] != "websocket.connect":
        return
    client = WebSocketClient(tunnel)
    target = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    if scope.get("query_string"):
        target += "?" + scope["query_string"].decode("latin-1")
    headers = _forwarded(scope["headers"], _WS_OWN)
    host = Headers(scope=scope).get("host", "localhost")
    try:
        await client.handshake(host, target, headers, scope.get("subprotocols", ()))
    except (WebSocketError, NodeError, TimeoutError) as exc:
        raise _Refusal(502, f"the server in the sandbox refused the WebSocket: {exc}") from None
    await send({"type": "websocket.accept", "subprotocol": client.subprotocol})
    try:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(_ws_to_guest(receive, client))
            tasks.create_task(_ws_to_client(send, client))
    except* (_ClientGone, WebSocketError, NodeError, OSError):
        pass
    finally:
        await client.close()


async def _ws_to_guest(receive: Receive, client: WebSocketClient) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "websocket.disconnect":
            await client.close(message.get("code", 1000))
            raise _ClientGone
        if message.get("bytes") is not None:
            await client.send(message["bytes"])
        elif message.get("text") is not None:
            await client.send(message["text"])


async def _ws_to_client(send: Send, client: WebSocketClient) -> None:
    while (message := await client.receive()) is not None:
        if isinstance(message, str):
            await send({"type": "websocket.send", "text": message})
        else:
            await send({"type": "websocket.send", "bytes": message})
    code = client.close_code or 1000
    await send({"type": "websocket.close", "code": 1000 if code in (1005, 1006) else code})
    raise _ClientGone  # the guest closed: stop reading the client too
