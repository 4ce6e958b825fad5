"""Runs inside a guest: one network attempt, described by JSON in argv[1].

Prints one JSON line: ``{"ok": true, "detail": ...}`` when the attempt got an answer
from the other end, ``{"ok": false, "detail": ...}`` when it did not. Stdlib only (it
runs on the guest's python3). Uploaded by tests/integration/test_egress.py.
"""

import json
import socket
import struct
import sys

TIMEOUT_S = 4.0
#: How long an attempt waits for an answer to datagrams: one that would come crosses
#: only the host's veth and comes in milliseconds; these attempts are all meant to be
#: dropped, so what they cost is this wait.
SILENCE_S = 2.0


def http(
    host: str,
    port: int = 80,
    path: str = "/",
    header_host: str | None = None,
    address: str | None = None,
) -> str:
    target = address or host
    with socket.create_connection((target, port), timeout=TIMEOUT_S) as sock:
        name = header_host if header_host is not None else host
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
        return _read_all(sock)


def tls(
    host: str,
    port: int = 443,
    sni: str = "",
    address: str | None = None,
    header_host: str | None = None,
) -> str:
    # ssl (like urllib below) is imported by the attempts that use it alone: loading
    # libssl takes 0.3 s of a TCG guest's CPU, at every probe run.
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    raw = socket.create_connection((address or host, port), timeout=TIMEOUT_S)
    with raw, context.wrap_socket(raw, server_hostname=sni or None) as sock:
        name = header_host or host
        sock.sendall(f"GET / HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
        return _read_all(sock)


def https(url: str, headers: dict[str, str] | None = None) -> str:
    """A verified HTTPS request with the guest's own trust store (urllib)."""
    import urllib.request

    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
        return str(answer.read().decode(errors="replace"))


def tcp(address: str, port: int, data: str = "hello") -> str:
    with socket.create_connection((address, port), timeout=TIMEOUT_S) as sock:
        sock.sendall(data.encode())
        return _read_all(sock)


def udp(address: str, port: int, data: str = "hello") -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(SILENCE_S)
        sock.sendto(data.encode(), (address, port))
        return sock.recvfrom(4096)[0].decode(errors="replace")


def udp6(address: str, port: int, data: str = "hello") -> str:
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as sock:
        sock.settimeout(SILENCE_S)
        sock.sendto(data.encode(), (address, port))
        return sock.recvfrom(4096)[0].decode(errors="replace")


def tcp6(address: str, port: int) -> str:
    with socket.create_connection((address, port), timeout=TIMEOUT_S) as sock:
        return _read_all(sock)


def icmp(address: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        sock.settimeout(SILENCE_S)
        body = struct.pack("!BBHHH", 8, 0, 0, 1, 1) + b"probe"
        checksum = _checksum(body)
        sock.sendto(body[:2] + struct.pack("!H", checksum) + body[4:], (address, 0))
        while True:
            data, peer = sock.recvfrom(4096)
            if peer[0] == address and data[20] == 0:  # an echo reply from it
                return f"echo reply from {peer[0]}"


def raw_ip(address: str, protocol: int = 253) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, protocol) as sock:
        sock.settimeout(SILENCE_S)
        sock.sendto(b"raw probe", (address, 0))
        return sock.recvfrom(4096)[0].hex()


def dns(name: str, qtype: int = 1, server: str = "192.0.2.1", port: int = 53) -> dict[str, object]:
    query = struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    for label in name.rstrip(".").split("."):
        query += bytes([len(label)]) + label.encode()
    query += b"\0" + struct.pack("!HH", qtype, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.sendto(query, (server, port))
        reply = sock.recvfrom(4096)[0]
    flags, _, answers = struct.unpack("!2xHHH", reply[:8])
    return {"rcode": flags & 0xF, "answers": answers, "reply": reply.hex()}


def find(needle_hex: str) -> list[str]:
    """Every place in the guest that holds the bytes ``needle_hex`` spells: files (but
    the kernel's own trees), and every process's environment and command line. (In
    hex, so this probe's own command line does not hold them.)"""
    import os

    found = []
    data = bytes.fromhex(needle_hex)
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        for part in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as file:
                    if data in file.read():
                        found.append(f"/proc/{pid}/{part}")
            except OSError:
                pass
    for root, dirs, files in os.walk("/"):
        if root == "/":
            dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
        for name in files:
            path = os.path.join(root, name)
            try:
                if os.path.islink(path) or os.path.getsize(path) > 4 << 20:
                    continue
                with open(path, "rb") as file:
                    if data in file.read():
                        found.append(path)
            except OSError:
                pass
    if found:
        raise RuntimeError(f"found in {found}")
    return found


def resolve(name: str) -> str:
    return socket.gethostbyname(name)


def _read_all(sock: socket.socket) -> str:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data.decode(errors="replace")
        data += chunk


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def main() -> None:
    request = json.loads(sys.argv[1])
    kind = request.pop("kind")
    try:
        detail = globals()[kind](**request)
        print(json.dumps({"ok": True, "detail": detail}))
    except Exception as exc:  # every failure is an answer, not a crash
        print(json.dumps({"ok": False, "detail": f"{type(exc).__name__}: {exc}"}))


if __name__ == "__main__":
    main()
