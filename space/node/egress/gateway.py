"""The node's egress gateway: listeners inside every sandbox's namespace, one process.

For each attached sandbox the gateway serves, bound inside that sandbox's network
namespace, a TCP listener that nftables redirects every guest connection to, and a DNS
responder on UDP 53. The node binds both (it alone may enter a namespace: the gateway
runs unprivileged, issue 18) and hands them over; they are served here, in the host's
namespace, where the gateway itself connects out. A sandbox's identity is the listener
its traffic arrived on, so no packet a guest forges can make it pass for another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass, replace
from ipaddress import IPv4Address
from typing import cast

from mitmproxy import certs

from space.node.api import (
    EgressEvent,
    EgressPolicy,
    InvalidArgument,
    PolicyBounds,
    SecretGrant,
    check_grants,
    decode_grants,
    host_addresses,
)
from space.node.egress import dns
from space.node.egress.audit import AuditLog
from space.node.egress.connection import Refused, Route, Streams, Tracker, serve
from space.node.egress.fakeip import FakeIps
from space.node.egress.intercept import Exchange, Interceptor, load_ca
from space.node.egress.local_addresses import LocalAddresses
from space.node.egress.resolver import Resolver
from space.node.network.fd_lines import close_fds

__all__ = ["Gateway", "GatewayError", "Listeners"]

log = logging.getLogger(__name__)

#: Connections one sandbox may hold open through the gateway at once.
MAX_CONNECTIONS = 512


class GatewayError(Exception):
    """A request to the gateway failed (unknown sandbox, namespace gone, bad policy)."""


@dataclass(frozen=True, eq=False)
class Listeners:
    """A sandbox's listeners as the node bound them: TCP (listening) and UDP (DNS)."""

    tcp: socket.socket
    udp: socket.socket

    @classmethod
    def adopt(cls, fds: list[int]) -> Listeners:
        """The listeners of descriptors received, owning them: ``[tcp, udp]``, both
        AF_INET. Raises GatewayError, having closed them all, for anything else."""
        sockets: list[socket.socket] = []
        try:
            for fd in fds:
                sockets.append(socket.socket(fileno=fd))
        except OSError as exc:
            _close_all(sockets, fds[len(sockets) :])
            raise GatewayError(f"a listener is not a socket: {exc}") from exc
        kinds = [(s.family, s.type) for s in sockets]
        if kinds != [(socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET, socket.SOCK_DGRAM)]:
            _close_all(sockets, [])
            raise GatewayError("an attach takes two listeners: TCP then UDP")
        for sock in sockets:
            sock.setblocking(False)
        return cls(sockets[0], sockets[1])

    def close(self) -> None:
        self.tcp.close()
        self.udp.close()


def _close_all(sockets: list[socket.socket], fds: list[int]) -> None:
    for sock in sockets:
        sock.close()
    close_fds(fds)


@dataclass(eq=False)
class _Attached:
    netns: str
    tracker: Tracker
    fake: FakeIps
    server: asyncio.Server
    dns: asyncio.DatagramTransport


class Gateway:
    """Attach, re-policy and detach sandboxes; everything else happens on its own."""

    def __init__(
        self,
        audit: AuditLog,
        resolver: Resolver,
        interceptor: Interceptor,
        bounds: PolicyBounds | None = None,
    ) -> None:
        """``bounds``: what policies may name (the operator's, as the node has them);
        None is the strictest."""
        self._audit = audit
        self._bounds = bounds or PolicyBounds()
        self._resolver = resolver
        self._interceptor = interceptor
        self._local = LocalAddresses()
        self._attached: dict[str, _Attached] = {}
        self._cas: dict[str, certs.CertStore] = {}

    def decisions(self) -> dict[str, int]:
        """The allow and deny decisions audited since this gateway began (AuditLog)."""
        return self._audit.decisions()

    async def attach(
        self,
        sandbox_id: str,
        netns: str,
        policy: object,
        ca: bytes | None,
        listeners: Listeners | None,
    ) -> bool:
        """Serve the sandbox, whose namespace ``netns`` names, under ``policy`` (JSON),
        terminating its TLS with the CA ``ca`` (key and certificate, PEM); takes
        ``listeners`` over (closed when unused or on error). Idempotent: a second attach
        with the same namespace only sets the policy and CA.

        Returns False, having changed nothing, when the sandbox is not served in
        ``netns`` yet and no ``listeners`` came: the node binds them and asks again.
        Raises GatewayError (bad policy or CA)."""
        try:
            parsed = self._parse(policy)
            store = self._load_ca(sandbox_id, ca)
        except GatewayError:
            if listeners is not None:
                listeners.close()
            raise
        current = self._attached.get(sandbox_id)
        if current is not None and current.netns == netns:
            if listeners is not None:
                listeners.close()  # the namespace's own are served already
            current.tracker.set_policy(parsed)
        elif listeners is None:
            return False
        else:
            await self.detach(sandbox_id)
            self._attached[sandbox_id] = await self._listen(sandbox_id, netns, listeners, parsed)
        if store is not None:
            self._cas[sandbox_id] = store
        return True

    def _load_ca(self, sandbox_id: str, ca: bytes | None) -> certs.CertStore | None:
        try:
            return load_ca(ca, self._interceptor.dhparam) if ca is not None else None
        except (OSError, ValueError) as exc:
            raise GatewayError(f"cannot load the CA of {sandbox_id}: {exc}") from exc

    def set_secrets(self, sandbox_id: str, grants: object) -> None:
        """Replace the sandbox's secret grants. GatewayError (never naming a value) if
        the sandbox is not attached or a grant is malformed."""
        attached = self._attached.get(sandbox_id)
        if attached is None:
            raise GatewayError(f"sandbox {sandbox_id} is not attached")
        attached.tracker.grants = _grants(grants)

    def set_policy(self, sandbox_id: str, policy: object) -> None:
        """Use ``policy`` for new connections and DNS now; cut connections it no longer
        allows. GatewayError if the sandbox is not attached or the policy is bad."""
        parsed = self._parse(policy)
        attached = self._attached.get(sandbox_id)
        if attached is None:
            raise GatewayError(f"sandbox {sandbox_id} is not attached")
        attached.tracker.set_policy(parsed)

    async def detach(self, sandbox_id: str) -> None:
        """Close the sandbox's listeners and cut its connections; idempotent."""
        self._cas.pop(sandbox_id, None)
        attached = self._attached.pop(sandbox_id, None)
        if attached is None:
            return
        attached.server.close()
        attached.dns.close()
        for task in list(attached.tracker.live):
            task.cancel()
        with contextlib.suppress(Exception):
            await attached.server.wait_closed()

    async def retain(self, sandbox_ids: set[str]) -> None:
        """Detach every sandbox not in ``sandbox_ids`` (those a node deleted while
        another agent ran, or never knew of after its state was lost)."""
        for sandbox_id in list(self._attached):
            if sandbox_id not in sandbox_ids:
                await self.detach(sandbox_id)

    async def close(self) -> None:
        await self.retain(set())

    def _parse(self, policy: object) -> EgressPolicy:
        """The policy within the operator's bounds and the host's addresses of now."""
        bounds = replace(self._bounds, own_addresses=host_addresses())
        try:
            return EgressPolicy.parse(policy if policy is not None else {}, bounds)
        except InvalidArgument as exc:
            raise GatewayError(exc.message) from exc

    async def _listen(
        self, sandbox_id: str, netns: str, listeners: Listeners, policy: EgressPolicy
    ) -> _Attached:
        fake = FakeIps()
        tracker = Tracker(
            sandbox_id=sandbox_id,
            policy=policy,
            name_for=lambda a: fake.name_for(a) if isinstance(a, IPv4Address) else None,
            is_synthetic=FakeIps.contains,
            resolver=self._resolver,
            is_local=self._local,
            audit=lambda event: self._audit.write(sandbox_id, event),
            intercept=self._intercept,
        )

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if len(tracker.live) >= MAX_CONNECTIONS:
                writer.transport.abort()
                return
            await serve(tracker, reader, writer)

        loop = asyncio.get_running_loop()
        server = await asyncio.start_server(accepted, sock=listeners.tcp)
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _DnsResponder(tracker, fake, self._audit), sock=listeners.udp
        )
        return _Attached(netns, tracker, fake, server, transport)

    async def _intercept(
        self,
        tracker: Tracker,
        routed: Route,
        first: bytes,
        guest: Streams,
        original: tuple[str, int],
    ) -> None:
        ca = self._cas.get(tracker.sandbox_id)
        assert routed.name is not None
        if ca is None:
            raise Refused(
                "TLS and HTTP need the sandbox's CA, which it has not got", host=routed.name
            )
        exchange = Exchange(
            sandbox_id=tracker.sandbox_id,
            name=routed.name,
            address=str(routed.address),
            port=routed.port,
            grants=lambda: tracker.grants,
            audit=tracker.audit,
            ca=ca,
        )
        await self._interceptor.handle(exchange, first, guest[0], guest[1], original)


def _grants(data: object) -> list[SecretGrant]:
    try:
        grants = decode_grants({"grants": data})
        check_grants(grants)
    except InvalidArgument as exc:  # its messages never quote a value
        raise GatewayError(exc.message) from None
    return grants


class _DnsResponder(asyncio.DatagramProtocol):
    def __init__(self, tracker: Tracker, fake: FakeIps, audit: AuditLog) -> None:
        self._tracker, self._fake, self._audit = tracker, fake, audit
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's own datagram transport does not subclass DatagramTransport.
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        try:
            reply, event = dns.answer(data, self._tracker.policy, self._fake)
        except Exception:  # the responder must outlive any query
            log.exception("DNS answer failed for sandbox %s", self._tracker.sandbox_id)
            return
        # Audited before the guest hears the answer: what it learns is on record.
        if event is not None:
            self._write(event)
        if reply is not None and self._transport is not None:
            self._transport.sendto(reply, addr)

    def _write(self, event: EgressEvent) -> None:
        self._audit.write(self._tracker.sandbox_id, event)
