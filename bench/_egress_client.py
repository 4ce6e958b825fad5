"""The client side of bench_egress.py: timed HTTP(S) requests, one connection each.

Runs with ``python3 _egress_client.py '<json>'`` in whichever network namespace it is
started in (stdlib only). Prints a JSON list of (seconds, body bytes) per request.
"""

import json
import socket
import ssl
import struct
import sys
import time


def resolve(name: str, server: str) -> str:
    """A plain DNS A query (the gateway's resolver answers with a synthetic address)."""
    query = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        query += bytes([len(label)]) + label.encode()
    query += b"\0" + struct.pack("!HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(3)
        sock.sendto(query, (server, 53))
        reply = sock.recv(512)
    return socket.inet_ntoa(reply[-4:])


def fetch(address: str, port: int, host: str, path: str, context: ssl.SSLContext | None) -> int:
    raw = socket.create_connection((address, port), timeout=30)
    sock = context.wrap_socket(raw, server_hostname=host) if context else raw
    with sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        size = 0
        while chunk := sock.recv(1 << 20):
            size += len(chunk)
    return size


def main() -> None:
    args = json.loads(sys.argv[1])
    address = args["address"] or resolve(args["host"], args["dns"])
    context = None
    if args["ca"]:
        context = ssl.create_default_context(cafile=args["ca"])
    results = []
    for _ in range(args["count"]):
        started = time.perf_counter()
        size = fetch(address, args["port"], args["host"], args["path"], context)
        results.append((time.perf_counter() - started, size))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
