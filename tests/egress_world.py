"""A small "internet" for egress tests, in a network namespace the test creates.

The namespace hangs off the host by one veth pair. Its addresses are documentation
ones, which the gateway takes for public: TEST-NET-2 (198.51.100.0/24), or TEST-NET-3,
then TEST-NET-1, where the host already has an address or a route in it (these
machines have sat in TEST-NET-1 and reached their package mirror in TEST-NET-3; a
world there would shadow them and be shadowed). Its private network is 10.99.0.0/24,
or 172.29 or 192.168.99, likewise. Each pytest-xdist worker has its own quarter of the
public /24 (a /26) and its own private /24, so worlds of the VM lane's two workers
never share a route; the table is worker gw0's where nothing is taken (gw1 adds 64 to
the last byte of the public addresses and 1 to the third of the private ones). A new
world checks that the host reaches its upstream server, and fails naming the host's
addresses and routes if not. Servers run as threads of the test process, their
sockets bound inside the namespace (or on the host's side, for the canaries that must
never be reached):

| address          | where           | what                                            |
|------------------|-----------------|-------------------------------------------------|
| 198.51.100.1     | host's veth end | canary HTTP :8080 (the node itself)             |
| 198.51.100.2     | namespace       | DNS :53, HTTP :80 and :8080, TLS :443, UDP :9999 |
| 198.51.100.3     | namespace       | HTTP :80 ("other", a host no policy names)      |
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
import json
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
from .workers import xdist_worker

__all__ = ["Hit", "World", "egress_world"]

#: This process's pytest-xdist worker (0 outside xdist): which quarter of the public
#: /24 and which private /24 its worlds use.
WORKER = xdist_worker()
if WORKER > 3:
    raise RuntimeError("egress worlds have addresses for four pytest-xdist workers at most")
#: Where a world's addresses may come from, in order of preference (the module docstring).
_PUBLIC_BLOCKS = ("198.51.100", "203.0.113", "192.0.2")
_PRIVATE_BLOCKS = ("10.99", "172.29", "192.168")
_PRIVATE_THIRD = {"192.168": 99}


def _host_networks() -> list[ipaddress.IPv4Network]:
    """The host's IPv4 addresses and routes, in every table, but its default routes and
    the veths of egress worlds (this worker's stale ones are cleared; others' are theirs)."""
    out = subprocess.run(
        ["ip", "-j", "-4", "route", "show", "table", "all"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return [
        ipaddress.IPv4Network(route["dst"], strict=False)
        for route in json.loads(out)
        if route.get("dst", "default") != "default" and not route.get("dev", "").startswith("spt")
    ]


def _free(candidates: list[str], taken: list[ipaddress.IPv4Network]) -> str:
    for network in candidates:
        if not any(ipaddress.ip_network(network).overlaps(used) for used in taken):
            return network
    raise RuntimeError(
        f"no network for an egress world: the host has addresses or routes in each of "
        f"{candidates} ({', '.join(map(str, taken))})"
    )


_TAKEN = _host_networks()
#: The world's quarter of a public /24, and its private network (PRIVATE's).
WORLD_NET = _free([f"{block}.{64 * WORKER}/26" for block in _PUBLIC_BLOCKS], _TAKEN)
PRIVATE_NET = _free(
    [f"{b}.{_PRIVATE_THIRD.get(b, 0) + WORKER}.0/24" for b in _PRIVATE_BLOCKS], _TAKEN
)
_BASE = ipaddress.ip_network(WORLD_NET).network_address
_PRIVATE_BASE = ipaddress.ip_network(PRIVATE_NET).network_address
HOST_SIDE = str(_BASE + 1)
UPSTREAM = str(_BASE + 2)
OTHER = str(_BASE + 3)
PRIVATE = str(_PRIVATE_BASE + 2)
#: The host's end of the veth also holds this, the source of its packets to PRIVATE.
HOST_PRIVATE_SIDE = str(_PRIVATE_BASE + 1)
_LINK = "u0"
_ETH_P_ALL, _ETH_P_IP, _ETH_P_IPV6 = 0x0003, 0x0800, 0x86DD
_PACKET_OUTGOING = 4
_CLONE_NEWNET = 0x40000000
#: The host-side veths of the worlds this process has open: the worker's addresses
#: allow one at a time.
_OPEN: set[str] = set()


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
    _clear_stale_worlds()
    tag = secrets.token_hex(3)
    name, host_veth = f"spt-{tag}", f"spt{tag}"
    _run("ip", "netns", "add", name)
    _OPEN.add(host_veth)
    try:
        _run("ip", "link", "add", host_veth, "type", "veth", "peer", "name", _LINK, "netns", name)
        _run("ip", "addr", "add", f"{HOST_SIDE}/26", "dev", host_veth)
        _run("ip", "addr", "add", f"{HOST_PRIVATE_SIDE}/24", "dev", host_veth)
        _run("ip", "link", "set", host_veth, "up")
        for address in (f"{UPSTREAM}/26", f"{OTHER}/26", f"{PRIVATE}/24"):
            _run("ip", "-n", name, "addr", "add", address, "dev", _LINK)
        _run("ip", "-n", name, "link", "set", _LINK, "up")
        _run("ip", "-n", name, "link", "set", "lo", "up")
        directory = Path(tempfile.mkdtemp(prefix="space-egress-world-"))
        world = World(Path("/run/netns") / name, directory=directory)
        try:
            _start_servers(world)
            _check_reached(world)
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
        _OPEN.discard(host_veth)
        _delete_world(host_veth)


def _delete_world(host_veth: str) -> None:
    """Delete a world's namespace and its veth (the pair goes with either end)."""
    subprocess.run(["ip", "netns", "delete", f"spt-{host_veth[3:]}"], check=False)
    subprocess.run(["ip", "link", "delete", host_veth], check=False, capture_output=True)


def _clear_stale_worlds() -> None:
    """Delete this worker's worlds that a killed test process left: the routes of their
    veths, on the same addresses, would take a new world's traffic. A world this process
    still has open is a test's bug (two at once), and says so."""
    links = json.loads(subprocess.run(
        ["ip", "-j", "-4", "addr", "show"], check=True, capture_output=True, text=True
    ).stdout)  # fmt: skip
    for link in links:
        name = link.get("ifname", "")
        if not any(a.get("local") == HOST_SIDE for a in link.get("addr_info", [])):
            continue
        if name in _OPEN:
            raise RuntimeError(
                f"a second egress world of worker {WORKER} while {name} is open: "
                "they would share its addresses"
            )
        if name.startswith("spt"):
            _delete_world(name)


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


def _check_reached(world: World) -> None:
    """Fail, naming the host's addresses and routes, unless the host reaches the world's
    upstream server: a test whose every egress attempt fails for that reason would
    otherwise blame the gateway. The check's own hit is not kept."""
    token = f"world-check-{secrets.token_hex(4)}"
    try:
        with socket.create_connection((UPSTREAM, 80), timeout=5) as sock:
            sock.sendall(f"GET / HTTP/1.1\r\nHost: {token}\r\n\r\n".encode())
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
    except OSError as exc:
        answer = repr(exc).encode()
    world.hits[:] = [hit for hit in world.hits if hit.host != token]
    if not answer.endswith(f"upstream host={token}\n".encode()):
        shown = [
            subprocess.run(argv, capture_output=True, text=True, check=False).stdout
            for argv in (["ip", "-4", "-br", "addr"], ["ip", "-4", "route", "show", "table", "all"])
        ]
        raise RuntimeError(
            f"the host does not reach the egress world's upstream {UPSTREAM}:80 "
            f"({answer[-200:]!r}); its addresses:\n{shown[0]}its routes:\n{shown[1]}"
        )


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
