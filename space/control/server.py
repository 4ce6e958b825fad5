"""Running the control plane: uvicorn in the current event loop, and node registration."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from space.control.app import create_app
from space.control.nodes import NodeRegistry, capacity_report, remote_factory
from space.control.schemas import NodeCapacity
from space.control.settings import ControlSettings
from space.node.api import NodeError, NodeService, Unavailable
from space.node.api.http_connections import (
    HEADER_TIMEOUT_S,
    MAX_CONNECTIONS_PER_CLIENT,
    guarded_protocol,
)
from space.node.http.client import error_from_response

__all__ = [
    "DEFAULT_HEARTBEAT_S",
    "TlsFiles",
    "heartbeat",
    "register_remote_node",
    "run_control_plane",
]

#: How often a node heartbeats when the control plane does not say, and the least
#: often it may be told to (a control plane cannot make nodes flood it).
DEFAULT_HEARTBEAT_S = 5.0
MIN_HEARTBEAT_S = 0.2


@dataclass(frozen=True)
class TlsFiles:
    """The REST API's certificate chain and private key, both PEM (``--tls-cert/--tls-key``).

    ``check`` loads them as the server will, so an unreadable file, a file that is not
    PEM or a key that does not match the certificate is one clear ValueError before
    anything starts, not a traceback from uvicorn once the node is up.
    """

    cert: Path
    key: Path

    def check(self) -> None:
        """Raise ValueError naming the file and the problem if the pair cannot be served."""
        for option, path in (("--tls-cert", self.cert), ("--tls-key", self.key)):
            try:
                with path.open("rb") as f:
                    f.read(1)
            except OSError as exc:
                raise ValueError(f"{option} {path}: cannot read it ({exc.strerror})") from None
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
        except ssl.SSLError as exc:
            problem = exc.reason or str(exc)
            raise ValueError(
                f"--tls-cert {self.cert} and --tls-key {self.key} cannot be served: {problem}"
            ) from None


async def run_control_plane(
    settings: ControlSettings,
    node: NodeService | None,
    *,
    host: str,
    port: int,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
    tls: TlsFiles | None = None,
) -> None:
    """Serve the REST API on ``host:port`` until cancelled (or SIGINT/SIGTERM); over
    HTTPS only with ``tls`` (then a plain HTTP request gets no answer).

    ``node`` (if given) is registered as "local"; it stays the caller's to close.
    Migrations are applied before the first request is accepted. Cancellation shuts
    the server down gracefully (listening socket closed, lifespan finished: the reaper
    stopped, the database disposed) before the CancelledError propagates. Raises
    Unavailable if the server could not start (e.g. the port is taken), ValueError if
    ``tls`` cannot be served (TlsFiles.check), before anything listens.

    A connection whose request headers are not complete within ``header_timeout_s``
    is closed, and so is one from a client address that already holds
    ``max_connections_per_client`` (space.node.api.http_connections).
    """
    if tls is not None:
        tls.check()
    registry = NodeRegistry(remote_factory=remote_factory(settings.node_ca_file))
    if node is not None:
        registry.register("local", node)
    app = create_app(settings, registry)
    http = guarded_protocol(
        header_timeout_s=header_timeout_s, max_per_client=max_connections_per_client
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level="info",
        http=http,
        ssl_certfile=None if tls is None else str(tls.cert),
        ssl_keyfile=None if tls is None else str(tls.key),
    )
    server = uvicorn.Server(config)
    with _listen(host, port) as sock:
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            # Cancelling uvicorn's serve() mid-way leaks its socket: ask it to exit instead.
            server.should_exit = True
            await serving
            raise


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket, bound here so a taken port is our Unavailable (uvicorn
    would sys.exit(1)).

    proto is IPPROTO_TCP, not socket.create_server's 0: asyncio sets TCP_NODELAY only on
    sockets whose proto says TCP, and without it every keep-alive response waited 40 ms
    for the client's delayed ACK (measured: 46 ms vs 4 ms per request).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise Unavailable(f"cannot listen on {host}:{port}: {exc}") from exc
    return sock


async def register_remote_node(
    control_url: str | Sequence[str],
    token: str,
    node_url: str,
    node_id: str,
    *,
    capacity: NodeCapacity | None = None,
    timeout_s: float = 30.0,
    verify: ssl.SSLContext | bool = True,
) -> float:
    """Register the node agent at ``node_url`` with the control plane at ``control_url``,
    or heartbeat it (the same call, with ``capacity``: it renews the node's lease).
    Several URLs (replicas without a load balancer in front) are tried in turn until one
    answers. Returns how often the control plane wants the heartbeat, in seconds.

    Idempotent. Raises space.node.api.errors leaves, of the last URL tried: Unavailable
    if the control plane is unreachable or rejects the token, the mapped leaf for any
    other error answer. ``verify``: what an https control plane's certificate is checked
    with (space.node.http.client.ca_context; True: the system's CAs).
    """
    urls = [control_url] if isinstance(control_url, str) else list(control_url)
    body: dict[str, object] = {"node_id": node_id, "url": node_url}
    if capacity is not None:
        body["capacity"] = capacity.model_dump()
    failure: NodeError = Unavailable("no control-plane URL to register with")
    async with httpx.AsyncClient(timeout=timeout_s, verify=verify) as client:
        for url in urls:
            try:
                return await _register(client, url, token, body)
            except NodeError as exc:
                failure = exc
    raise failure


async def _register(
    client: httpx.AsyncClient, control_url: str, token: str, body: dict[str, object]
) -> float:
    url = control_url.rstrip("/") + "/v1/nodes"
    try:
        response = await client.post(url, json=body, headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as exc:
        raise Unavailable(f"control plane at {control_url} unreachable: {exc!r}") from exc
    if response.status_code >= 400:
        error: NodeError = error_from_response(response.status_code, response.content, None)
        raise error
    try:
        heartbeat_s = float(response.json()["heartbeat_s"])
    except (ValueError, KeyError, TypeError):
        heartbeat_s = DEFAULT_HEARTBEAT_S  # an older control plane
    return min(max(heartbeat_s, MIN_HEARTBEAT_S), DEFAULT_HEARTBEAT_S * 12)


async def heartbeat(
    control_url: str | Sequence[str],
    token: str,
    node_url: str,
    node: NodeService,
    say: Callable[[str], None],
    every_s: float = DEFAULT_HEARTBEAT_S,
    verify: ssl.SSLContext | bool = True,
) -> None:
    """Heartbeat the registered ``node`` with its capacity until cancelled, first in
    ``every_s`` (what its registration returned), then as often as the control plane
    asks. A failed heartbeat is said once and retried at the next; the control plane
    marks the node lost if its lease runs out meanwhile, and active again at the next
    success."""
    failing = False
    while True:
        await asyncio.sleep(every_s)
        try:
            info = await node.info()
            every_s = await register_remote_node(
                control_url,
                token,
                node_url,
                info.node_id,
                capacity=capacity_report(info),
                verify=verify,
            )
        except NodeError as exc:
            if not failing:
                say(f"heartbeat failed (retrying every {every_s:g} s): {exc}")
            failing = True
            continue
        if failing:
            say("heartbeats succeed again")
        failing = False
