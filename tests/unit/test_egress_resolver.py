"""The gateway's upstream DNS client against a tiny DNS server on loopback.

The server (``Upstream``) answers every query in a way its test chooses. For the
spoofing test it first sends forged answers pointing at BAD: one with a wrong id, one
with a different question, then a right-looking one from a second socket on another
port and one from another loopback address (127.0.0.2, same port), and only then, after a
pause in which the client has read them all, the real answer. A truncated UDP answer
is served over TCP on the same port.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from ipaddress import IPv4Address

import dns.flags
import dns.message
import dns.rcode
import dns.rrset
import pytest

from space.node.egress.resolver import ResolveError, Resolver

pytestmark = pytest.mark.anyio

GOOD, BAD = "192.0.2.10", "203.0.113.66"
#: How long the server waits between the forged answers and the real one.
_PAUSE_S = 0.1

Reply = Callable[["Upstream", dns.message.Message, tuple[str, int]], None]


def _answer(query: dns.message.Message, address: str, **changes: int) -> bytes:
    response = dns.message.make_response(query)
    name = query.question[0].name
    response.answer.append(dns.rrset.from_text(name, 60, "IN", "A", address))
    response.id = changes.get("id", response.id)
    response.flags |= changes.get("flags", 0)
    return response.to_wire()


@dataclass
class Upstream:
    """UDP and TCP on one loopback port; two more UDP sockets to forge answers from."""

    reply: Reply
    udp: socket.socket = field(default_factory=lambda: socket.socket(type=socket.SOCK_DGRAM))
    tcp: socket.socket = field(default_factory=socket.socket)
    other_port: socket.socket = field(default_factory=lambda: socket.socket(type=socket.SOCK_DGRAM))
    other_address: socket.socket = field(
        default_factory=lambda: socket.socket(type=socket.SOCK_DGRAM)
    )
    ids: list[int] = field(default_factory=list)
    tcp_queries: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def port(self) -> int:
        return int(self.udp.getsockname()[1])

    def serve_udp(self) -> None:
        while not self._stop.is_set():
            try:
                wire, peer = self.udp.recvfrom(4096)
            except TimeoutError:
                continue
            query = dns.message.from_wire(wire)
            self.ids.append(query.id)
            self.reply(self, query, peer)

    def serve_tcp(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.tcp.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                size = int.from_bytes(conn.recv(2, socket.MSG_WAITALL), "big")
                query = dns.message.from_wire(conn.recv(size, socket.MSG_WAITALL))
                self.tcp_queries += 1
                wire = _answer(query, GOOD)
                conn.sendall(len(wire).to_bytes(2, "big") + wire)


def _bound(reply: Reply, attempts: int = 20) -> Upstream:
    """An Upstream whose sockets are bound; the UDP port the kernel picks may be taken
    for TCP or on 127.0.0.2 by another process, so a clash picks again."""
    for _ in range(attempts):
        server = Upstream(reply)
        sockets = (server.udp, server.tcp, server.other_port, server.other_address)
        try:
            server.udp.bind(("127.0.0.1", 0))
            server.tcp.bind(("127.0.0.1", server.port))
            server.other_port.bind(("127.0.0.1", 0))
            server.other_address.bind(("127.0.0.2", server.port))
            return server
        except OSError as error:
            for sock in sockets:
                sock.close()
            if error.errno != errno.EADDRINUSE:
                raise
    raise AssertionError(f"no loopback port free for UDP and TCP in {attempts} tries")


@contextlib.contextmanager
def upstream(reply: Reply) -> Iterator[Upstream]:
    """A running Upstream; on exit its threads are joined and its sockets closed."""
    server = _bound(reply)
    sockets = (server.udp, server.tcp, server.other_port, server.other_address)
    try:
        server.tcp.listen()
        for sock in sockets:
            sock.settimeout(0.05)
        threads = [threading.Thread(target=f) for f in (server.serve_udp, server.serve_tcp)]
        for thread in threads:
            thread.start()
        try:
            yield server
        finally:
            server._stop.set()
            for thread in threads:
                thread.join(timeout=5)
            assert not any(thread.is_alive() for thread in threads)
    finally:
        for sock in sockets:
            sock.close()


def _spoofed_then_real(server: Upstream, query: dns.message.Message, peer: tuple[str, int]) -> None:
    server.udp.sendto(_answer(query, BAD, id=query.id ^ 0x5A5A), peer)
    other = dns.message.make_query("evil.example.", "A")
    other.id = query.id
    server.udp.sendto(_answer(other, BAD), peer)
    server.other_port.sendto(_answer(query, BAD), peer)
    server.other_address.sendto(_answer(query, BAD), peer)
    server.udp.sendto(b"\x00", peer)
    time.sleep(_PAUSE_S)
    server.udp.sendto(_answer(query, GOOD), peer)


def _truncated(server: Upstream, query: dns.message.Message, peer: tuple[str, int]) -> None:
    server.udp.sendto(_answer(query, BAD, flags=dns.flags.TC), peer)


def _replying(make: Callable[[dns.message.Message], dns.message.Message]) -> Reply:
    def reply(server: Upstream, query: dns.message.Message, peer: tuple[str, int]) -> None:
        server.udp.sendto(make(query).to_wire(want_shuffle=False), peer)  # keep order

    return reply


def _silent(server: Upstream, query: dns.message.Message, peer: tuple[str, int]) -> None:
    del server, query, peer


def _resolver(*servers: Upstream, timeout_s: float = 2.0) -> Resolver:
    return Resolver([("127.0.0.1", server.port) for server in servers], timeout_s=timeout_s)


async def test_spoofed_answers_are_ignored_and_the_real_answer_wins() -> None:
    with upstream(_spoofed_then_real) as server:
        resolver = _resolver(server)
        for _ in range(4):
            assert await resolver.resolve("api.example.com") == [IPv4Address(GOOD)]
    assert len(server.ids) == 4 and len(set(server.ids)) > 1  # a fresh random id each time


async def test_a_truncated_udp_answer_is_asked_again_over_tcp() -> None:
    with upstream(_truncated) as server:
        assert await _resolver(server).resolve("big.example.com") == [IPv4Address(GOOD)]
    assert server.tcp_queries == 1


async def test_a_cname_chain_is_followed_and_other_names_records_left_out() -> None:
    def chained(query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        response.answer += [
            dns.rrset.from_text("www.example.com.", 60, "IN", "CNAME", "cdn.example.net."),
            dns.rrset.from_text("cdn.example.net.", 60, "IN", "A", GOOD, "192.0.2.11"),
            dns.rrset.from_text("unrelated.example.", 60, "IN", "A", BAD),
        ]
        return response

    with upstream(_replying(chained)) as server:
        addresses = await _resolver(server).resolve("www.example.com")
    assert addresses == [IPv4Address(GOOD), IPv4Address("192.0.2.11")]


async def test_negative_nxdomain_is_a_resolve_error() -> None:
    def nxdomain(query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        response.set_rcode(dns.rcode.NXDOMAIN)
        return response

    with upstream(_replying(nxdomain)) as server, pytest.raises(ResolveError, match="NXDOMAIN"):
        await _resolver(server).resolve("nope.example.com")


async def test_negative_an_answer_without_an_a_record_is_a_resolve_error() -> None:
    with (
        upstream(_replying(dns.message.make_response)) as server,
        pytest.raises(ResolveError, match="no IPv4 address"),
    ):
        await _resolver(server).resolve("v6only.example.com")


async def test_a_silent_resolver_times_out_and_the_next_one_is_asked() -> None:
    with upstream(_silent) as silent, upstream(_spoofed_then_real) as real:
        started = time.monotonic()
        resolver = _resolver(silent, real, timeout_s=0.3)
        assert await resolver.resolve("api.example.com") == [IPv4Address(GOOD)]
        assert 0.3 <= time.monotonic() - started < 2.0


async def test_negative_no_resolver_answering_is_a_resolve_error() -> None:
    with upstream(_silent) as silent, pytest.raises(ResolveError, match="Timeout"):
        await _resolver(silent, timeout_s=0.2).resolve("api.example.com")


async def test_negative_no_resolver_configured_is_a_resolve_error() -> None:
    with pytest.raises(ResolveError, match="no DNS resolver"):
        await Resolver([]).resolve("api.example.com")


@pytest.mark.parametrize("name", ["a..b", "x" * 64 + ".example.com", "a." * 130 + "b"])
async def test_negative_an_invalid_name_is_a_resolve_error_without_a_query(name: str) -> None:
    with upstream(_silent) as server, pytest.raises(ResolveError, match="not a DNS name"):
        await _resolver(server).resolve(name)
    assert server.ids == []
