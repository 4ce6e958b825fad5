"""One TCP connection of a sandbox through the gateway: decide, pin, inspect, relay.

The order is what makes it safe:

1. *Route* by where the guest was going (SO_ORIGINAL_DST). A synthetic address the
   gateway's DNS handed out stands for a name, which must match a domain rule for the
   port; any other address must be named by a CIDR rule. Anything else is refused.
2. *Pin*: a name is resolved now, by the gateway, and the connection goes to the first
   address that may be used; that same address, no second lookup (no DNS rebinding).
   Addresses of the host itself and loopback are never used, whatever the rules.
3. *Inspect* the guest's first bytes before forwarding any of them: TLS must carry an SNI equal
   to the routed name, HTTP a single Host equal to it. A connection routed by a CIDR
   rule has no name to match, so it is not asked for one.
4. *Relay* both ways, counting bytes, until either side is done or the policy that
   allowed the connection no longer does.

Every refusal resets the guest's connection and is audited; failures fail closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address

from space.node.egress.netns_socket import original_destination
from space.node.egress.resolver import ResolveError, Resolver
from space.node.egress.sniff import Head, sniff
from space.node.egress_policy import EgressPolicy, blocked_category
from space.node.interface import EgressEvent

__all__ = ["Refused", "Route", "Tracker", "route", "serve"]

_CONNECT_TIMEOUT_S = 10.0
_CHUNK = 64 * 1024

IPAddress = IPv4Address | IPv6Address


class Refused(Exception):
    """The gateway will not carry this connection; ``reason`` says why, briefly."""

    def __init__(self, reason: str, *, host: str | None = None, address: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.host = host
        self.address = address


@dataclass(frozen=True, slots=True)
class Route:
    """Where a connection goes: ``name`` is None for one allowed by a CIDR rule."""

    name: str | None
    address: IPAddress
    port: int

    def still_allowed(self, policy: EgressPolicy) -> bool:
        if self.name is None:
            return policy.allows_address(self.address, self.port).allowed
        return policy.domain_rule_for(self.name, self.port) is not None


@dataclass(eq=False)
class Tracker:
    """What one sandbox's connections share: its policy, names, audit and resolver."""

    sandbox_id: str
    policy: EgressPolicy
    name_for: Callable[[IPAddress], str | None]
    is_synthetic: Callable[[IPAddress], bool]
    resolver: Resolver
    is_local: Callable[[IPAddress], bool]
    audit: Callable[[EgressEvent], None]
    live: dict[asyncio.Task[None], Route] = field(default_factory=dict)

    def set_policy(self, policy: EgressPolicy) -> None:
        """Use ``policy`` from now on; connections it no longer allows are cut."""
        self.policy = policy
        for task, live_route in list(self.live.items()):
            if not live_route.still_allowed(policy):
                task.cancel()


async def route(tracker: Tracker, destination: IPAddress, port: int) -> Route:
    """Decide and pin where a connection to ``destination:port`` goes; Refused if not."""
    policy = tracker.policy
    if tracker.is_synthetic(destination):
        name = tracker.name_for(destination)
        if name is None:
            raise Refused("unknown synthetic address", address=str(destination))
        if policy.domain_rule_for(name, port) is None:
            raise Refused(f"no rule for {name} port {port}", host=name)
        return Route(name, await _pin(tracker, name, port), port)
    verdict = policy.allows_address(destination, port)
    if not verdict.allowed:
        raise Refused(verdict.reason, address=str(destination))
    _refuse_host_itself(tracker, destination, None)
    return Route(None, destination, port)


async def _pin(tracker: Tracker, name: str, port: int) -> IPAddress:
    try:
        addresses = await tracker.resolver.resolve(name)
    except ResolveError as exc:
        raise Refused(f"resolve failed: {exc}", host=name) from exc
    first_refusal: Refused | None = None
    for address in addresses:
        verdict = tracker.policy.address_usable_for_domain(address, port)
        try:
            if not verdict.allowed:
                raise Refused(verdict.reason, host=name, address=str(address))
            _refuse_host_itself(tracker, address, name)
        except Refused as refusal:
            first_refusal = first_refusal or refusal
            continue
        return address
    assert first_refusal is not None  # resolve() returns at least one address
    raise first_refusal


def _refuse_host_itself(tracker: Tracker, address: IPAddress, name: str | None) -> None:
    if blocked_category(address) in ("loopback", "unspecified") or tracker.is_local(address):
        raise Refused("blocked address: the node itself", host=name, address=str(address))


def check_head(head: Head, routed: Route) -> None:
    """Refused unless the guest's first message agrees with the routed name."""
    if head.kind == "bad":
        raise Refused(head.error or "malformed request", host=routed.name)
    if routed.name is None or head.kind == "other":
        return
    if head.kind == "tls" and head.host is None:
        raise Refused("TLS without SNI", host=routed.name)
    if head.host != routed.name:
        raise Refused(f"{head.kind} names {head.host!r}, routed as {routed.name}", host=head.host)
    if head.kind == "http" and head.port not in (None, routed.port):
        raise Refused(f"Host port {head.port} differs from {routed.port}", host=head.host)


async def serve(
    tracker: Tracker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Carry one accepted connection of the sandbox to its end (never raises)."""
    started, port = time.time(), None
    try:
        text, port = original_destination(writer.get_extra_info("socket"))
        routed = await route(tracker, ipaddress.ip_address(text), port)
        async with asyncio.timeout(_CONNECT_TIMEOUT_S):
            upstream = await asyncio.open_connection(str(routed.address), routed.port)
    except Refused as refusal:
        _refuse(tracker, writer, refusal, port, started)
        return
    except (OSError, TimeoutError) as exc:
        _refuse(tracker, writer, Refused(f"connect failed: {exc}"), port, started)
        return
    task = asyncio.current_task()
    assert task is not None
    tracker.live[task] = routed
    try:
        await _carry(tracker, routed, (reader, writer), upstream, started)
    finally:
        tracker.live.pop(task, None)


Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _carry(
    tracker: Tracker, routed: Route, guest: Streams, upstream: Streams, started: float
) -> None:
    """Relay both ways; the guest's first message is checked before any of it is sent
    (the server's side flows from the start, for protocols where the server speaks
    first)."""
    counts = [0, 0]
    protocol = ["tcp"]
    reason = "policy"
    try:
        await asyncio.gather(
            _pump_guest(routed, guest[0], upstream[1], counts, protocol),
            _pump(upstream[0], guest[1], counts, 1),
        )
    except Refused as refusal:
        upstream[1].transport.abort()
        _refuse(tracker, guest[1], refusal, routed.port, started, protocol[0])
        return
    except asyncio.CancelledError:
        reason = "cut: policy changed"
    except OSError as exc:
        reason = f"ended: {type(exc).__name__}"
    finally:
        upstream[1].transport.abort()
        guest[1].transport.abort()
    tracker.audit(_event(routed, protocol[0], "allow", reason, counts, started))


async def _pump_guest(
    routed: Route,
    source: asyncio.StreamReader,
    sink: asyncio.StreamWriter,
    counts: list[int],
    protocol: list[str],
) -> None:
    if routed.name is not None:
        head, first = await _read_head(source)
        protocol[0] = head.kind if head.kind in ("tls", "http") else "tcp"
        check_head(head, routed)
        sink.write(first)
        counts[0] += len(first)
    await _pump(source, sink, counts, 0)


async def _read_head(reader: asyncio.StreamReader) -> tuple[Head, bytes]:
    """The guest's first message, whole (bounded in size by sniff, not in time: the
    guest may wait for the server to speak first)."""
    data = b""
    while (head := sniff(data)) is None:
        chunk = await reader.read(_CHUNK)
        if not chunk:
            return Head("other"), data
        data += chunk
    return head, data


async def _pump(
    source: asyncio.StreamReader, sink: asyncio.StreamWriter, counts: list[int], index: int
) -> None:
    while chunk := await source.read(_CHUNK):
        sink.write(chunk)
        counts[index] += len(chunk)
        await sink.drain()
    with contextlib.suppress(OSError):
        if sink.can_write_eof():
            sink.write_eof()


def _refuse(
    tracker: Tracker,
    writer: asyncio.StreamWriter,
    refusal: Refused,
    port: int | None,
    started: float,
    protocol: str = "tcp",
) -> None:
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):  # linger 0: close with a reset, not a FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
    tracker.audit(
        EgressEvent(
            time=started,
            protocol=protocol,
            host=refusal.host,
            address=refusal.address,
            port=port,
            decision="deny",
            reason=refusal.reason,
        )
    )


def _event(
    routed: Route, protocol: str, decision: str, reason: str, counts: list[int], started: float
) -> EgressEvent:
    return EgressEvent(
        time=started,
        protocol=protocol,
        host=routed.name,
        address=str(routed.address),
        port=routed.port,
        decision=decision,
        reason=reason,
        bytes_out=counts[0],
        bytes_in=counts[1],
    )
