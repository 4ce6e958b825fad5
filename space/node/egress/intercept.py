"""TLS termination and HTTP inspection of name-routed connections, by mitmproxy.

A connection the gateway routed by name (space.node.egress.connection) and whose first
message is TLS or HTTP is handed to mitmproxy's proxy core in transparent mode, with
the pinned address as its server. mitmproxy terminates the guest's TLS with a leaf
certificate signed by the sandbox's own CA (the guest trusts that CA, nothing else of
ours), verifies the upstream's certificate against the node's trust store, and parses
every HTTP request. Per request this module then:

- refuses it unless its Host (or :authority, or absolute-form URL) names the routed
  host on the routed port: no domain fronting, no virtual-host hopping on a connection;
- swaps in the secrets bound to that host (space.node.api.interface.SecretGrant): a
  placeholder in a header, Basic credentials or the URL, or a header of its own; and
  scrubs their values out of the response before it reaches the guest;
- audits it, naming the secrets it used.

Any server connection other than the pinned address is refused at connect time.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from mitmproxy import certs, http, options
from mitmproxy.addons.next_layer import NextLayer
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.addons.tlsconfig import TlsConfig
from mitmproxy.connection import Client
from mitmproxy.master import Master
from mitmproxy.proxy import mode_specs
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.modes import TransparentProxy
from mitmproxy.proxy.mode_servers import ProxyConnectionHandler

from space.node.api import EgressEvent, SecretGrant, host_matches

__all__ = ["Exchange", "Interceptor", "load_ca"]

log = logging.getLogger(__name__)

#: Bodies larger than this stream through instead of being held whole.
_STREAM_BODIES = "256k"


def load_ca(raw: bytes, dhparam_path: Path) -> certs.CertStore:
    """A CertStore issuing leaves from the CA ``raw`` (key and certificate, PEM); the DH
    parameters are read from ``dhparam_path``, written there first if missing. The node
    sends the CA's PEM: its file stays root's (docs/security.md). Raises ValueError,
    OSError."""
    key = serialization.load_pem_private_key(raw, None)
    cert = x509.load_pem_x509_certificate(raw)
    dhparams = certs.CertStore.load_dhparam(dhparam_path)
    return certs.CertStore(key, certs.Cert(cert), None, dhparams)  # type: ignore[arg-type]


@dataclass(eq=False)
class Exchange:
    """One intercepted connection: where it may go and what it may carry."""

    sandbox_id: str
    name: str
    address: str
    port: int
    grants: Callable[[], list[SecretGrant]]
    audit: Callable[[EgressEvent], None]
    ca: certs.CertStore
    used: set[str] = field(default_factory=set)


class _Replay:
    """A reader that returns bytes already read from the guest before the rest."""

    def __init__(self, first: bytes, reader: asyncio.StreamReader) -> None:
        self._first, self._reader = first, reader

    async def read(self, n: int = -1) -> bytes:
        if self._first:
            data, self._first = self._first, b""
            return data
        return await self._reader.read(n)


class _SandboxTls(TlsConfig):
    """mitmproxy's TLS setup, with each sandbox's leaves issued by its own CA."""

    def __init__(self, exchanges: dict[str, Exchange]) -> None:
        super().__init__()
        self._exchanges = exchanges

    def get_cert(self, conn_context: Context) -> certs.CertStoreEntry:
        exchange = self._exchanges.get(conn_context.client.id)
        if exchange is None:  # not ours: refuse rather than fall back to a shared CA
            raise ValueError("no sandbox CA for this connection")
        name = x509.DNSName(exchange.name)
        return exchange.ca.get_cert(exchange.name, [name])


class _Checks:
    """The per-request policy, as mitmproxy hooks."""

    def __init__(self, exchanges: dict[str, Exchange]) -> None:
        self._exchanges = exchanges

    def server_connect(self, data: Any) -> None:
        exchange = self._exchanges.get(data.client.id)
        wanted = None if exchange is None else (exchange.address, exchange.port)
        if data.server.address != wanted:
            data.server.error = f"refused: {data.server.address} is not the pinned address"

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        exchange = self._exchanges.get(flow.client_conn.id)
        if exchange is None:
            flow.kill()
            return
        problem = _host_problem(flow.request, exchange)
        if problem is not None:
            exchange.audit(_request_event(exchange, flow, "deny", problem, ()))
            flow.response = http.Response.make(
                421, f"space egress: {problem}\n", {"content-type": "text/plain"}
            )
            return
        used = _inject(flow.request, exchange)
        flow.metadata["space_secrets"] = used
        exchange.used.update(used)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        exchange = self._exchanges.get(flow.client_conn.id)
        if exchange is None or flow.response is None:
            return
        grants = [g for g in exchange.grants() if g.name in flow.metadata.get("space_secrets", ())]
        if not grants:
            return
        for name, value in list(flow.response.headers.items(multi=True)):
            flow.response.headers[name] = _scrub(value, grants)
        if flow.response.stream:
            flow.response.stream = lambda chunk: _scrub_bytes(chunk, grants)

    def response(self, flow: http.HTTPFlow) -> None:
        exchange = self._exchanges.get(flow.client_conn.id)
        if exchange is None or flow.response is None:
            return
        used = tuple(flow.metadata.get("space_secrets", ()))
        grants = [g for g in exchange.grants() if g.name in used]
        if grants and flow.response.raw_content is not None:
            flow.response.content = _scrub_bytes(flow.response.content or b"", grants)
        exchange.audit(_request_event(exchange, flow, "allow", "request", used))

    def error(self, flow: http.HTTPFlow) -> None:
        exchange = self._exchanges.get(flow.client_conn.id)
        if exchange is not None and flow.error is not None and flow.response is None:
            reason = f"failed: {flow.error.msg}"[:200]
            exchange.audit(_request_event(exchange, flow, "deny", reason, ()))


class Interceptor:
    """mitmproxy's proxy core, driven connection by connection (it listens nowhere)."""

    def __init__(self, confdir: Path, upstream_ca: Path | None) -> None:
        confdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        #: Where the DH parameters of every sandbox's CertStore are kept.
        self.dhparam = confdir / "dhparam.pem"
        self._exchanges: dict[str, Exchange] = {}
        opts = options.Options()
        self._master = Master(opts, event_loop=asyncio.get_running_loop())
        self._master.addons.add(
            _Checks(self._exchanges), Proxyserver(), NextLayer(), _SandboxTls(self._exchanges)
        )
        settings: dict[str, object] = {
            "confdir": str(confdir),
            "mode": [],
            "upstream_cert": False,
            "stream_large_bodies": _STREAM_BODIES,
            "connection_strategy": "lazy",
        }
        if upstream_ca is not None:
            settings["ssl_verify_upstream_trusted_ca"] = str(upstream_ca)
        opts.update(**settings)
        self._mode = mode_specs.ProxyMode.parse("transparent")

    async def handle(
        self,
        exchange: Exchange,
        first: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        original: tuple[str, int],
    ) -> None:
        """Carry the guest's connection through mitmproxy until it ends."""
        handler = ProxyConnectionHandler(
            self._master, _Replay(first, reader), writer, self._master.options, self._mode
        )
        context = handler.layer.context
        handler.layer = TransparentProxy(context)
        client: Client = context.client
        client.sockname = original
        context.server.address = (exchange.address, exchange.port)
        self._exchanges[client.id] = exchange
        try:
            await handler.handle_client()
        finally:
            self._exchanges.pop(client.id, None)
            with contextlib.suppress(Exception):
                writer.transport.abort()


def _host_problem(request: http.Request, exchange: Exchange) -> str | None:
    header = request.host_header
    if header is None:
        return "request without Host"
    host, _, port = header.rpartition(":") if header.count(":") == 1 else (header, "", "")
    if host.lower().rstrip(".") != exchange.name:
        return f"Host {header!r} is not {exchange.name}"
    if port and port != str(exchange.port):
        return f"Host port {port} is not {exchange.port}"
    if request.authority and request.authority.lower().rstrip(".") not in (
        exchange.name,
        f"{exchange.name}:{exchange.port}",
    ):
        return f"request target {request.authority!r} is not {exchange.name}"
    return None


def _inject(request: http.Request, exchange: Exchange) -> tuple[str, ...]:
    used = []
    for grant in exchange.grants():
        if not host_matches(grant.hosts, exchange.name):
            continue
        if grant.injection == "header":
            assert grant.header is not None
            request.headers[grant.header] = grant.format.replace("{value}", grant.value)
            used.append(grant.name)
            continue
        touched = _replace_in_headers(request.headers, grant)
        if grant.placeholder in request.path:
            request.path = request.path.replace(grant.placeholder, grant.value)
            touched = True
        if touched:
            used.append(grant.name)
    return tuple(used)


def _replace_in_headers(headers: http.Headers, grant: SecretGrant) -> bool:
    """Swap the placeholder in every header field, repeated ones included, and inside
    the base64 of Basic credentials (git and pip send a token as a password that way).
    Bodies are left alone on purpose: a body is often stored by the bound host (an
    issue, a gist), which would hand the value to whoever reads it later."""
    placeholder, value = grant.placeholder.encode(), grant.value.encode()
    fields, touched = [], False
    for name, raw in headers.fields:
        new = raw.replace(placeholder, value)
        if name.lower() == b"authorization":
            new = _replace_in_basic(new, placeholder, value)
        touched = touched or new != raw
        fields.append((name, new))
    if touched:
        headers.fields = tuple(fields)
    return touched


def _replace_in_basic(header: bytes, placeholder: bytes, value: bytes) -> bytes:
    scheme, _, credentials = header.strip().partition(b" ")
    if scheme.lower() != b"basic":
        return header
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True)
    except binascii.Error:
        return header
    if placeholder not in decoded:
        return header
    return scheme + b" " + base64.b64encode(decoded.replace(placeholder, value))


def _scrub(text: str, grants: list[SecretGrant]) -> str:
    for grant in grants:
        text = text.replace(grant.value, grant.placeholder)
    return text


def _scrub_bytes(data: bytes, grants: list[SecretGrant]) -> bytes:
    for grant in grants:
        data = data.replace(grant.value.encode(), grant.placeholder.encode())
    return data


def _request_event(
    exchange: Exchange, flow: http.HTTPFlow, decision: str, reason: str, used: tuple[str, ...]
) -> EgressEvent:
    request, response = flow.request, flow.response
    sent = len(request.raw_content or b"")
    received = 0 if response is None else len(response.raw_content or b"")
    scheme = "https" if flow.client_conn.tls else "http"
    return EgressEvent(
        time=request.timestamp_start or time.time(),
        protocol=scheme,
        host=exchange.name,
        address=exchange.address,
        port=exchange.port,
        decision=decision,
        reason=f"{request.method} {reason}" if decision == "allow" else reason,
        bytes_out=sent,
        bytes_in=received,
        secrets=used,
    )
