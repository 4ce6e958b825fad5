"""The gateway's own DNS client: resolves a name at connect time, every time.

Each connection resolves afresh and connects to exactly the address it checked, so an
answer that changes between a check and a connect (DNS rebinding) cannot slip a private
address in: there is no second lookup. No cache, for the same reason. Answers come from
the node's configured resolvers over UDP, coded with mitmproxy's DNS message type; a
reply that does not match the query (id, question) is ignored, as a spoofed one would be.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from ipaddress import IPv4Address

from mitmproxy import dns
from mitmproxy.net.dns import classes, response_codes, types

__all__ = ["ResolveError", "Resolver"]

_TIMEOUT_S = 2.0
_MAX_REPLY = 4096


class ResolveError(Exception):
    """The name did not resolve (no such name, no address, or no resolver answered)."""


class Resolver:
    """Asks ``servers`` in turn for a name's IPv4 addresses."""

    def __init__(self, servers: Sequence[tuple[str, int]]) -> None:
        self._servers = list(servers)

    async def resolve(self, name: str) -> list[IPv4Address]:
        """The A records of ``name`` (CNAMEs followed by the resolver), in answer order.

        Raises ResolveError when the name does not exist, has no A record, or no
        resolver answered within its timeout.
        """
        if not self._servers:
            raise ResolveError("no DNS resolver configured")
        last = "no resolver answered"
        for server in self._servers:
            try:
                reply = await _ask(server, name)
            except (OSError, TimeoutError, ValueError) as exc:
                last = f"resolver {server[0]}:{server[1]}: {type(exc).__name__} {exc}".strip()
                continue
            if reply.response_code != response_codes.NOERROR:
                raise ResolveError(f"{name}: {response_codes.to_str(reply.response_code)}")
            addresses = [
                rr.ipv4_address
                for rr in reply.answers
                if rr.type == types.A and rr.class_ == classes.IN and len(rr.data) == 4
            ]
            if not addresses:
                raise ResolveError(f"{name}: no IPv4 address")
            return addresses
        raise ResolveError(last)


async def _ask(server: tuple[str, int], name: str) -> dns.Message:
    query = dns.Message(
        timestamp=time.time(),
        id=random.randrange(1 << 16),
        query=True,
        op_code=0,
        authoritative_answer=False,
        truncation=False,
        recursion_desired=True,
        recursion_available=False,
        reserved=0,
        response_code=0,
        questions=[dns.Question(name=name, type=types.A, class_=classes.IN)],
        answers=[],
        authorities=[],
        additionals=[],
    )
    loop = asyncio.get_running_loop()
    replies: asyncio.Queue[bytes] = asyncio.Queue(maxsize=16)
    transport, _ = await loop.create_datagram_endpoint(
        lambda: _Collector(replies), remote_addr=server
    )
    try:
        transport.sendto(query.packed)
        async with asyncio.timeout(_TIMEOUT_S):
            while True:
                reply = _matching(await replies.get(), query)
                if reply is not None:
                    return reply
    finally:
        transport.close()


def _matching(data: bytes, query: dns.Message) -> dns.Message | None:
    try:
        reply = dns.Message.unpack(data)
    except Exception:  # whatever mitmproxy's unpacking raises on garbage
        return None
    if reply.query or reply.id != query.id or reply.questions != query.questions:
        return None
    return reply


class _Collector(asyncio.DatagramProtocol):
    def __init__(self, queue: asyncio.Queue[bytes]) -> None:
        self._queue = queue

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        if len(data) <= _MAX_REPLY and not self._queue.full():
            self._queue.put_nowait(data)
