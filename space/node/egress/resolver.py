"""The gateway's own DNS client: resolves a name at connect time, every time.

Each connection resolves afresh and connects to exactly the address it checked, so an
answer that changes between a check and a connect (DNS rebinding) cannot slip a private
address in: there is no second lookup. No cache, for the same reason.

Answers come from the node's configured resolvers (address and port each), asked in
turn with dnspython (issue 16): the query id comes from the system's secure random
source, a reply from another address or port, or whose id or question does not match
the query, is ignored as a spoofed one would be, and a truncated UDP reply is asked
again over TCP. Each resolver gets ``TIMEOUT_S`` for both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from ipaddress import IPv4Address

import dns.asyncquery
import dns.exception
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rdtypes.IN.A

__all__ = ["TIMEOUT_S", "ResolveError", "Resolver"]

#: How long one resolver has to answer, UDP and a TCP retry together.
TIMEOUT_S = 2.0


class ResolveError(Exception):
    """The name did not resolve (no such name, no address, or no resolver answered)."""


class Resolver:
    """Asks ``servers`` (address, port) in turn for a name's IPv4 addresses."""

    def __init__(self, servers: Sequence[tuple[str, int]], *, timeout_s: float = TIMEOUT_S):
        self._servers = list(servers)
        self._timeout_s = timeout_s

    async def resolve(self, name: str) -> list[IPv4Address]:
        """The A records of ``name`` (CNAMEs followed by the resolver), in answer order.

        Raises ResolveError when the name is not a valid DNS name, does not exist, has no
        A record, or no resolver answered within its timeout (the next one is asked
        then). A resolver's answer other than NOERROR ends the lookup. Cancelling it
        leaves nothing behind: each query's socket is closed.
        """
        if not self._servers:
            raise ResolveError("no DNS resolver configured")
        try:
            query = dns.message.make_query(dns.name.from_text(name), dns.rdatatype.A)
        except (dns.exception.DNSException, ValueError) as exc:
            raise ResolveError(f"{name[:300]!r}: not a DNS name ({exc})") from None
        last = "no resolver answered"
        for address, port in self._servers:
            try:
                async with asyncio.timeout(self._timeout_s):
                    reply, _ = await dns.asyncquery.udp_with_fallback(
                        query, address, port=port, ignore_unexpected=True, ignore_errors=True
                    )
            except (OSError, EOFError, TimeoutError, dns.exception.DNSException) as exc:
                last = f"resolver {address}:{port}: {type(exc).__name__} {exc}".strip()
                continue
            return _addresses(name, reply)
        raise ResolveError(last)


def _addresses(name: str, reply: dns.message.Message) -> list[IPv4Address]:
    if reply.rcode() != dns.rcode.NOERROR:
        raise ResolveError(f"{name}: {dns.rcode.to_text(reply.rcode())}")
    try:
        if not isinstance(reply, dns.message.QueryMessage):  # what a QUERY's reply reads as
            raise dns.message.NotQueryResponse
        answer = reply.resolve_chaining().answer
    except dns.exception.DNSException as exc:
        raise ResolveError(f"{name}: bad answer ({type(exc).__name__})") from None
    # The A records of the name the CNAME chain ends at, not those of other names.
    if answer is None or answer.rdclass != dns.rdataclass.IN:
        raise ResolveError(f"{name}: no IPv4 address")
    addresses = [IPv4Address(r.address) for r in answer if isinstance(r, dns.rdtypes.IN.A.A)]
    if not addresses:
        raise ResolveError(f"{name}: no IPv4 address")
    return addresses
