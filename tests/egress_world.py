"""A small "internet" for egress tests, in a network namespace the test creates.

The namespace hangs off the host by one veth pair. Its addresses are TEST-NET-2
(198.51.100.0/24): these machines reach their package mirror in TEST-NET-3 and sit in
TEST-NET-1 themselves, so neither may be shadowed. Servers run as threads of the test
process, their sockets bound inside the namespace (or on the host's side, for the
canaries that must never be reached):

| address          | where           | what                                            |
|------------------|-----------------|-------------------------------------------------|
| 198.51.100.1      | host's veth end | canary HTTP :8080 (the node itself)             |
| 198.51.100.2      | namespace       | DNS :53, HTTP :80 and :8080, TLS :443, UDP :9999 |
| 198.51.100.3      | namespace       | HTTP :80 ("other", a host no policy names)      |
| 10.99.0.2        | namespace       | canary HTTP :80 (a private address)             |
| 127.0.0.1        | host loopback   | canary HTTP on a free port                      |

The DNS server answers from ``World.records`` (a name maps to a list of addresses, or
to a list of such lists served in turn: DNS rebinding) and remembers every name it was
asked. Every server remembers who talked to it and the Host it was sent.

With ``watch_strays=True`` a packet socket on the namespace's link also records, as hits
of "stray", every packet that arrives from anywhere but the host's own veth addresses:
whatever a sandbox forges or sends outside the gateway (UDP, ICMP, raw IP, a spoofed
source) shows up there if it ever gets out.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import ipaddress
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from mitmproxy import dns
from mitmproxy.net.dns import response_codes, types

from space.node.privileged.netns_socket import bind_in_netns

from .tls import write_self_signed

__all__ = ["Hit", "World", "egress_world"]

UPSTREAM = "198.51.100.2"
OTHER = "198.51.100.3"
HOST_SIDE = "198.51.100.1"
PRIVATE = "10.99.0.2"
#: The host's end of the veth also holds this, the source of its packets to PRIVATE.
HOST_PRIVATE_SIDE = "10.99.0.1"
_LINK = "u0"
_ETH_P_ALL, _ETH_P_IP, _ETH_P_IPV6 = 0x0003, 0x0800, 0x86DD
_PACKET_OUTGOING = 4
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Hit:
    server: str
    peer: str
    host: str | None
    data: bytes = b""


@dataclass
class World:
    netns: Path
    records: dict[str, list[str] | list[list[str]]] = field(default_factory=dict)
    asked: list[tuple[str, int]] = field(default_factory=list)
    hits: list[Hit] = field(default_factory=list)
    loopback_port: int = 0
    #: The TLS server's self-signed certificate: the node's upstream trust store.
    upstream_ca: Path = Path()
    directory: Path = Path()
    _turns: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _sockets: list[socket.socket] = field(default_factory=list)

    @property
    def resolver(self) -> str:
        return f"{UPSTREAM}:53"

    def hits_of(self, server: str) -> list[Hit]:
        return [hit for hit in list(self.hits) if hit.server == server]

    def answer_for(self, name: str) -> list[str] | None:
        entry = self.records.get(name)
        if not entry:
            return None
        if all(isinstance(item, str) for item in entry):
            return [str(item) for item in entry]
        turn = self._turns.get(name, 0)
        self._turns[name] = turn + 1
        chosen = entry[turn % len(entry)]
        return [chosen] if isinstance(chosen, str) else list(chosen)


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@contextlib.contextmanager
def egress_world(*, watch_strays: bool = False) -> Iterator[World]:
    """Make the namespace and servers; on exit stop them and delete the namespace (its
    veth end on the host goes with it), even if the test failed. ``watch_strays`` also
    records stray packets (see the module docstring): off by default, as it reads every
    packet of the link in Python."""
    tag = secrets.token_hex(3)
    name, host_veth = f"spt-{tag}", f"spt{tag}"
    _run("ip", "netns", "add", name)
    try:
        _run("ip", "link", "add", host_veth, "type", "veth", "peer", "name", _LINK, "netns", name)
        _run("ip", "addr", "add", f"{HOST_SIDE}/24", "dev", host_veth)
        _run("ip", "addr", "add", f"{HOST_PRIVATE_SIDE}/24", "dev", host_veth)
        _run("ip", "link", "set", host_veth, "up")
        for address in (f"{UPSTREAM}/24", f"{OTHER}/24", f"{PRIVATE}/24"):
            _run("ip", "-n", name, "addr", "add", address, "dev", _LINK)
        _run("ip", "-n", name, "link", "set", _LINK, "up")
        _run("ip", "-n", name, "link", "set", "lo", "up")
        directory = Path(tempfile.mkdtemp(prefix="space-egress-world-"))
        world = World(Path("/run/netns") / name, directory=directory)
        try:
            _start_servers(world)
            if watch_strays:
                _watch_strays(world)
            yield world
        finally:
            world._stop.set()
            for sock in world._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            shutil.rmtree(directory, ignore_errors=True)
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)
        subprocess.run(["ip", "link", "delete", host_veth], check=False, capture_output=True)


def _start_servers(world: World) -> None:
    inside = world.netns
    tls = _tls_context(world)
    servers = [
        ("upstream", bind_in_netns(inside, socket.SOCK_STREAM, (UPSTREAM, 80)), None),
        ("upstream:8080", bind_in_netns(inside, socket.SOCK_STREAM, (UPSTREAM, 8080)), None),
        ("tls", bind_in_netns(inside, socket.SOCK_STREAM, (UPSTREAM, 443)), tls),
        ("other", bind_in_netns(inside, socket.SOCK_STREAM, (OTHER, 80)), None),
        ("private", bind_in_netns(inside, socket.SOCK_STREAM, (PRIVATE, 80)), None),
        ("host", _listen((HOST_SIDE, 8080)), None),
        ("loopback", _listen(("127.0.0.1", 0)), None),
    ]
    world.loopback_port = servers[-1][1].getsockname()[1]
    for label, sock, context in servers:
        world._sockets.append(sock)
        _thread(_serve_http, world, label, sock, context)
    dns_sock = bind_in_netns(inside, socket.SOCK_DGRAM, (UPSTREAM, 53))
    udp_sock = bind_in_netns(inside, socket.SOCK_DGRAM, (UPSTREAM, 9999))
    world._sockets += [dns_sock, udp_sock]
    _thread(_serve_dns, world, dns_sock)
    _thread(_serve_udp, world, udp_sock)


def _listen(address: tuple[str, int]) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(64)
    return sock


def _thread(target: object, *args: object) -> None:
    threading.Thread(target=target, args=args, daemon=True).start()  # type: ignore[arg-type]


def _serve_http(
    world: World, label: str, sock: socket.socket, context: ssl.SSLContext | None
) -> None:
    sock.setblocking(True)
    while not world._stop.is_set():
        try:
            conn, peer = sock.accept()
        except OSError:
            return
        _thread(_answer_http, world, label, conn, peer[0], context)


def _answer_http(
    world: World, label: str, conn: socket.socket, peer: str, context: ssl.SSLContext | None
) -> None:
    with contextlib.suppress(OSError, ssl.SSLError), conn:
        conn.settimeout(10)
        stream: socket.socket = context.wrap_socket(conn, server_side=True) if context else conn
        _answer_on(world, label, stream, peer)


def _answer_on(world: World, label: str, stream: socket.socket, peer: str) -> None:
    with stream:
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 65536:
            chunk = stream.recv(4096)
            if not chunk:
                break
            head += chunk
        host = next(
            (
                line[5:].strip().decode(errors="replace")
                for line in head.split(b"\r\n")
                if line[:5].lower() == b"host:"
            ),
            None,
        )
        world.hits.append(Hit(label, peer, host, head[:200]))
        size = _requested_size(head)
        body = f"{label} host={host}\n".encode() if size is None else b"x" * size
        if head.split(b" ", 2)[1:2] == [b"/echo"]:
            body += head
        stream.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        )
        stream.sendall(body)


def _requested_size(head: bytes) -> int | None:
    """``GET /bytes/<n>`` asks for n bytes of body (the throughput benchmark)."""
    first = head.split(b"\r\n", 1)[0].split()
    if len(first) >= 2 and first[1].startswith(b"/bytes/") and first[1][7:].isdigit():
        return min(int(first[1][7:]), 1 << 31)
    return None


def _serve_dns(world: World, sock: socket.socket) -> None:
    sock.setblocking(True)
    while not world._stop.is_set():
        try:
            data, peer = sock.recvfrom(4096)
        except OSError:
            return
        if peer is None:  # shut down
            return
        with contextlib.suppress(Exception):
            query = dns.Message.unpack(data)
            question = query.questions[0]
            world.asked.append((question.name, question.type))
            addresses = world.answer_for(question.name.lower().rstrip("."))
            if addresses is None:
                reply = query.fail(response_codes.NXDOMAIN)
            elif question.type != types.A:
                reply = query.succeed([])
            else:
                reply = query.succeed(
                    [
                        dns.ResourceRecord.A(question.name, ipaddress.IPv4Address(a), ttl=1)
                        for a in addresses
                    ]
                )
            sock.sendto(reply.packed, peer)


def _serve_udp(world: World, sock: socket.socket) -> None:
    sock.setblocking(True)
    while not world._stop.is_set():
        try:
            data, peer = sock.recvfrom(4096)
        except OSError:
            return
        if peer is None:  # shut down
            return
        world.hits.append(Hit("udp", peer[0], None, data[:200]))
        with contextlib.suppress(OSError):
            sock.sendto(data, peer)


def _watch_strays(world: World) -> None:
    sock = _made_in_netns(world.netns, _packet_socket)
    sock.settimeout(0.5)  # a closed packet socket does not wake recvfrom: poll _stop
    world._sockets.append(sock)
    _thread(_serve_strays, world, sock)


def _packet_socket() -> socket.socket:
    """Every packet of the link, from its network header on (SOCK_DGRAM)."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(_ETH_P_ALL))
    sock.bind((_LINK, _ETH_P_ALL))
    return sock


def _serve_strays(world: World, sock: socket.socket) -> None:
    while not world._stop.is_set():
        try:
            data, (_, protocol, kind, *_) = sock.recvfrom(65536)
        except TimeoutError:
            continue
        except OSError:
            return
        source = _stray_source(data, protocol) if kind != _PACKET_OUTGOING else None
        if source is not None:
            world.hits.append(Hit("stray", source, None, data[:200]))


def _stray_source(data: bytes, protocol: int) -> str | None:
    """The source of a packet that the host did not send, or None."""
    if protocol == _ETH_P_IP and len(data) >= 20:
        source = str(ipaddress.IPv4Address(data[12:16]))
        return None if source in (HOST_SIDE, HOST_PRIVATE_SIDE) else source
    if protocol == _ETH_P_IPV6 and len(data) >= 40:
        address = ipaddress.IPv6Address(data[8:24])
        # The host's link-local chatter (neighbour discovery, MLD) is no stray.
        return None if address.is_link_local or address.is_unspecified else str(address)
    return None


def _made_in_netns(netns: Path, make: Callable[[], socket.socket]) -> socket.socket:
    """``make()`` run on a thread inside ``netns`` (a socket stays in the namespace it
    was made in), as space.node.network.netns_socket does for its AF_INET sockets."""
    result: list[socket.socket | BaseException] = []

    def enter_and_make() -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        target = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(target, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")
            try:
                result.append(make())
            finally:
                libc.setns(home, _CLONE_NEWNET)
        except BaseException as exc:
            result.append(exc)
        finally:
            os.close(target)
            os.close(home)

    thread = threading.Thread(target=enter_and_make)
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _tls_context(world: World) -> ssl.SSLContext:
    """A server context with a self-signed certificate for the test names (also kept
    as ``world.upstream_ca``, for the node to verify the server with)."""
    directory = world.directory
    names: list[x509.GeneralName] = [
        x509.DNSName(n) for n in ("allowed.test", "tls.allowed.test", "other.test")
    ]
    write_self_signed(directory / "cert.pem", directory / "key.pem", "allowed.test", names)
    world.upstream_ca = directory / "upstream-ca.pem"
    world.upstream_ca.write_bytes((directory / "cert.pem").read_bytes())
    world.upstream_ca.chmod(0o644)  # a certificate: public, as a host's CA bundle is
    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(directory / "cert.pem", directory / "key.pem")
    finally:
        (directory / "cert.pem").unlink()
        (directory / "key.pem").unlink()
    return context
