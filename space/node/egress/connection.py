"""One TCP connection of a sandbox through the gateway: decide, pin, inspect, relay.

The order is what makes it safe:

1. *Route* by where the guest was going (SO_ORIGINAL_DST). A synthetic address the
   gateway's DNS handed out stands for a name, which must match a domain rule for the
   port; any other address must be named by a CIDR rule. Anything else is refused.
2. *Pin*: a name is resolved now, by the gateway, and the connection goes to the first
   address that may be used; that same address, no second lookup (no DNS rebinding).
   Addresses of the host itself and loopback are never used, whatever the rules.
3. *Inspect* the guest's first message before forwarding any of it: TLS must carry an
   SNI equal to the routed name, HTTP a single Host equal to it. Both then go through
   mitmproxy (space.node.egress.intercept), which checks every later request too and
   injects secrets. A connection routed by a CIDR rule has no name to match: relayed.
4. *Relay* anything else both ways, counting bytes, until either side is done or the
   policy that allowed the connection no longer does.

Every refusal resets the guest's connection and is audited; failures fail closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address

from space.node.api import EgressEvent, EgressPolicy, SecretGrant, blocked_category
from space.node.egress.resolver import ResolveError, Resolver
from space.node.egress.sniff import Head, sniff

__all__ = ["Refused", "Route", "Tracker", "route", "serve"]

_CONNECT_TIMEOUT_S = 10.0
_SO_ORIGINAL_DST = 80
_CHUNK = 64 * 1024

IPAddress = IPv4Address | IPv6Address
Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
#: (tracker, route, first bytes, guest streams, original destination) -> carried to the end.
Intercept = Callable[["Tracker", "Route", bytes, Streams, tuple[str, int]], Awaitable[None]]
#: How long the guest may stay silent before the server is assumed to speak first.
_CLIENT_FIRST_S = 0.5


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
    #: Carries a TLS or HTTP connection routed by name (space.node.egress.intercept);
    #: None: such connections are refused (the sandbox has no CA yet).
    intercept: Intercept | None = None
    grants: list[SecretGrant] = field(default_factory=list)
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
    started, port, protocol = time.time(), None, "tcp"
    try:
        text, port = original_destination(writer.get_extra_info("socket"))
        routed = await route(tracker, ipaddress.ip_address(text), port)
        head, first = await _read_head(reader, routed)
        if head is not None:
            protocol = head.kind if head.kind in ("tls", "http") else "tcp"
            check_head(head, routed)
        if protocol != "tcp":
            await _intercepted(tracker, routed, first, (reader, writer), (text, port))
            return
        async with asyncio.timeout(_CONNECT_TIMEOUT_S):
            upstream = await asyncio.open_connection(str(routed.address), routed.port)
    except Refused as refusal:
        _refuse(tracker, writer, refusal, port, started, protocol)
        return
    except (OSError, TimeoutError) as exc:
        _refuse(tracker, writer, Refused(f"connect failed: {exc}"), port, started, protocol)
        return
    await _tracked(
        tracker, routed, _carry(tracker, routed, first, (reader, writer), upstream, started)
    )


async def _intercepted(
    tracker: Tracker, routed: Route, first: bytes, guest: Streams, original: tuple[str, int]
) -> None:
    if tracker.intercept is None:
        raise Refused("TLS and HTTP need the sandbox's CA, which it has not got", host=routed.name)
    await _tracked(tracker, routed, tracker.intercept(tracker, routed, first, guest, original))


async def _tracked(tracker: Tracker, routed: Route, work: Awaitable[None]) -> None:
    """Run ``work`` as a live connection of the sandbox (cut if the policy drops it)."""
    task = asyncio.current_task()
    assert task is not None
    tracker.live[task] = routed
    try:
        await work
    except asyncio.CancelledError:
        tracker.audit(_event(routed, "tcp", "allow", "cut: policy changed", [0, 0], time.time()))
    finally:
        tracker.live.pop(task, None)


async def _read_head(reader: asyncio.StreamReader, routed: Route) -> tuple[Head | None, bytes]:
    """The guest's first message, whole, on a connection routed by name. None if the
    guest is silent for a moment (the server speaks first) or routed by CIDR (no name
    to check it against). Bounded in size by sniff, and in time only until the first
    byte: a guest may wait for the server's greeting."""
    if routed.name is None:
        return None, b""
    data = b""
    try:
        async with asyncio.timeout(_CLIENT_FIRST_S):
            data = await reader.read(_CHUNK)
    except TimeoutError:
        return None, b""
    while (head := sniff(data)) is None:
        chunk = await reader.read(_CHUNK)
        if not chunk:
            return Head("other"), data
        data += chunk
    return head, data


async def _carry(
    tracker: Tracker,
    routed: Route,
    first: bytes,
    guest: Streams,
    upstream: Streams,
    started: float,
) -> None:
    """Relay both ways. The server's side flows from the start; a name-routed guest that
    was silent at first must not then start TLS or HTTP (those are intercepted, and a
    late start would dodge that)."""
    counts = [len(first), 0]
    reason = "policy"
    upstream[1].write(first)
    try:
        await asyncio.gather(
            _pump_guest(routed, guest[0], upstream[1], counts, late=not first),
            _pump(upstream[0], guest[1], counts, 1),
        )
    except Refused as refusal:
        upstream[1].transport.abort()
        _refuse(tracker, guest[1], refusal, routed.port, started)
        return
    except OSError as exc:
        reason = f"ended: {type(exc).__name__}"
    finally:
        upstream[1].transport.abort()
        guest[1].transport.abort()
    tracker.audit(_event(routed, "tcp", "allow", reason, counts, started))


async def _pump_guest(
    routed: Route,
    source: asyncio.StreamReader,
    sink: asyncio.StreamWriter,
    counts: list[int],
    *,
    late: bool,
) -> None:
    if late and routed.name is not None:
        data = b""
        while (head := sniff(data)) is None:
            chunk = await source.read(_CHUNK)
            if not chunk:
                break
            data += chunk
        if head is not None and head.kind != "other":
            raise Refused(f"{head.kind} after a silent start", host=routed.name)
        sink.write(data)
        counts[0] += len(data)
        if not data:
            with contextlib.suppress(OSError):
                sink.write_eof()
            return
    await _pump(source, sink, counts, 0)


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


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a redirected TCP connection was headed (conntrack's SO_ORIGINAL_DST)."""
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port, address = struct.unpack("!2xH4s8x", raw)
    return socket.inet_ntoa(address), port
