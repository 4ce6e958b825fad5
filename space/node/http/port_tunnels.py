"""Port tunnels over the node's HTTP API (issue 20, port exposure).

``GET {NODE_API_PREFIX}/sandboxes/{id}/ports/{port}/tunnel`` upgrades to a WebSocket
carrying one NodeService.open_port tunnel, so a control plane on another host (through
RemoteNode) reaches a server in a sandbox as the embedded node does. The node token is
checked from the upgrade's headers (the Edges middleware passes WebSocket scopes
through): a wrong one is refused before the upgrade (HTTP 403).

Messages, after the upgrade:

- node → client, first: text ``{"connected": port}``, or ``{"error": {"code",
  "message"}}`` then a close (the codes of space.node.api.errors);
- binary, both ways: the connection's bytes (at most MAX_TUNNEL_CHUNK_BYTES a message
  from the node; a client's are bounded by uvicorn's 16 MiB message cap);
- text ``eof``, both ways: that side finished sending (the guest server closed its side,
  or the client half-closes);
- the node closes the WebSocket once the tunnel has ended and the client sent ``eof``,
  or on any error (code 1011, the error as reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import ssl

from starlette.websockets import WebSocket, WebSocketDisconnect

from space.node.api import (
    ERROR_BY_CODE,
    NODE_API_PREFIX,
    NodeError,
    NodeService,
    PortTunnel,
    Unavailable,
)
from space.node.api.websocket_client import WebSocketClient, WebSocketError, connect_tcp

__all__ = ["EOF_MESSAGE", "RemotePortTunnel", "open_remote_tunnel", "serve_tunnel"]

EOF_MESSAGE = "eof"


def tunnel_path(sandbox_id: str, port: int) -> str:
    return f"{NODE_API_PREFIX}/sandboxes/{sandbox_id}/ports/{port}/tunnel"


async def serve_tunnel(
    websocket: WebSocket, node: NodeService, token: str, sandbox_id: str, port: int
) -> None:
    """The node's side: authenticate, open the tunnel, relay until both ends are done."""
    given = websocket.headers.get("authorization", "").encode()
    if not hmac.compare_digest(given, f"Bearer {token}".encode()):
        await websocket.close(code=1008)  # before accept: answered 403
        return
    await websocket.accept()
    try:
        tunnel = await node.open_port(sandbox_id, port)
    except NodeError as exc:
        error = {"code": exc.code, "message": exc.message}
        await websocket.send_text(json.dumps({"error": error}))
        await websocket.close(code=1011)
        return
    try:
        await websocket.send_text(json.dumps({"connected": port}))
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(_to_client(websocket, tunnel))
            tasks.create_task(_from_client(websocket, tunnel))
        await websocket.close(code=1000)
    except* (WebSocketDisconnect, NodeError, RuntimeError):
        pass
    finally:
        await tunnel.aclose()


async def _to_client(websocket: WebSocket, tunnel: PortTunnel) -> None:
    while data := await tunnel.read():
        await websocket.send_bytes(data)
    await websocket.send_text(EOF_MESSAGE)


async def _from_client(websocket: WebSocket, tunnel: PortTunnel) -> None:
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        if message.get("bytes") is not None:
            await tunnel.write(message["bytes"])
        elif message.get("text") == EOF_MESSAGE:
            await tunnel.close_write()
            return


class RemotePortTunnel:
    """PortTunnel over a node's tunnel WebSocket (the client's side)."""

    def __init__(self, client: WebSocketClient, port: int, sandbox_id: str) -> None:
        self.port = port
        self._client = client
        self._sandbox_id = sandbox_id
        self._ended = False

    async def read(self) -> bytes:
        while not self._ended:
            message = await self._receive()
            if isinstance(message, bytes):
                if message:
                    return message
            elif message is None or message == EOF_MESSAGE:
                self._ended = True
        return b""

    async def write(self, data: bytes) -> None:
        try:
            await self._client.send(data)
        except (WebSocketError, OSError) as exc:
            raise Unavailable(f"port tunnel broke: {exc}", sandbox_id=self._sandbox_id) from None

    async def close_write(self) -> None:
        with contextlib.suppress(WebSocketError, OSError):
            await self._client.send(EOF_MESSAGE)

    async def aclose(self) -> None:
        self._ended = True
        await self._client.close()

    async def _receive(self) -> bytes | str | None:
        try:
            return await self._client.receive()
        except (WebSocketError, OSError) as exc:
            raise Unavailable(f"port tunnel broke: {exc}", sandbox_id=self._sandbox_id) from None


async def open_remote_tunnel(
    base_url: str, token: str, verify: ssl.SSLContext | bool, sandbox_id: str, port: int
) -> RemotePortTunnel:
    """Connect to a node's tunnel route; raises the node's error, or Unavailable."""
    url = base_url + tunnel_path(sandbox_id, port)
    try:
        pipe, host, target = await connect_tcp(url, verify)
    except OSError as exc:
        raise Unavailable(f"node unreachable: {exc!r}", sandbox_id=sandbox_id) from None
    client = WebSocketClient(pipe)
    try:
        await client.handshake(host, target, [(b"authorization", f"Bearer {token}".encode())])
        first = await client.receive()
        answer = json.loads(first) if isinstance(first, str) else {}
    except (WebSocketError, OSError, TimeoutError, ValueError) as exc:
        await client.close()
        raise Unavailable(f"port tunnel refused: {exc}", sandbox_id=sandbox_id) from None
    if isinstance(answer, dict) and answer.get("connected") == port:
        return RemotePortTunnel(client, port, sandbox_id)
    await client.close()
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict):
        cls = ERROR_BY_CODE.get(str(error.get("code")), NodeError)
        raise cls(str(error.get("message", ""))[:1000], sandbox_id=sandbox_id)
    raise Unavailable("malformed port tunnel answer", sandbox_id=sandbox_id)
