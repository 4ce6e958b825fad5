"""What a sandbox's first bytes on a connection say about where it means to go.

The gateway reads the start of every connection before it forwards a byte: a TLS
ClientHello names its server (SNI), an HTTP/1 request its Host. Both are compared with
the name the connection was routed by. The TLS parser is mitmproxy's; this module only
decides when enough bytes are in and what they amount to. All input is hostile: sizes
are bounded and every parse failure is a refusal, never an exception.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from mitmproxy.proxy.layers.tls import parse_client_hello

__all__ = ["MAX_HEAD_BYTES", "Head", "sniff"]

#: The most a ClientHello or an HTTP request head may take before it is refused.
MAX_HEAD_BYTES = 64 * 1024

_HTTP_METHOD = re.compile(rb"^[A-Z]{3,10} ")
_TLS_HANDSHAKE = 0x16


@dataclass(frozen=True, slots=True)
class Head:
    """The start of a connection, once enough of it has arrived.

    ``kind`` "tls" (``host`` is the SNI, None if absent), "http" (``host`` is the Host
    header without a port, ``port`` that header's port if any), "other" (an unknown
    protocol), or "bad" (``error`` says what was wrong).
    """

    kind: Literal["tls", "http", "other", "bad"]
    host: str | None = None
    port: int | None = None
    error: str | None = None


def sniff(data: bytes) -> Head | None:
    """The Head of a connection that began with ``data``; None while more is needed."""
    if not data:
        return None
    if data[0] == _TLS_HANDSHAKE:
        return _tls(data)
    if _HTTP_METHOD.match(data[:11]) or (len(data) < 11 and data.isupper()):
        return _http(data)
    return Head("other")


def _tls(data: bytes) -> Head | None:
    try:
        hello = parse_client_hello(data)
    except Exception as exc:  # mitmproxy's parser raises whatever kaitai raises
        return Head("bad", error=f"malformed TLS ClientHello: {type(exc).__name__}")
    if hello is None:
        return _too_big(data, "TLS ClientHello")
    sni = hello.sni
    return Head("tls", host=sni.lower().rstrip(".") if sni else None)


def _http(data: bytes) -> Head | None:
    end = data.find(b"\r\n\r\n")
    if end < 0:
        if not _HTTP_METHOD.match(data[:11]) and len(data) >= 11:
            return Head("other")
        return _too_big(data, "HTTP request head")
    lines = data[:end].split(b"\r\n")
    hosts = [line[5:].strip() for line in lines[1:] if line[:5].lower() == b"host:"]
    if len(hosts) != 1:
        return Head("bad", error=f"HTTP request with {len(hosts)} Host headers")
    if any(b"\n" in line or b"\r" in line or line[:1] in (b" ", b"\t") for line in lines):
        return Head("bad", error="malformed HTTP request head")
    return _host_header(hosts[0])


def _host_header(value: bytes) -> Head:
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return Head("bad", error="non-ASCII Host header")
    host, port = text, None
    if text.startswith("["):  # an IPv6 literal: [addr]:port
        close = text.find("]")
        host, rest = text[1:close], text[close + 1 :]
        if close < 0 or (rest and not rest.startswith(":")):
            return Head("bad", error="malformed Host header")
        text_port = rest[1:] if rest else None
    elif ":" in text:
        host, text_port = text.rsplit(":", 1)
    else:
        text_port = None
    if text_port is not None:
        if not text_port.isdigit() or not 0 < int(text_port) < 65536:
            return Head("bad", error="malformed Host header port")
        port = int(text_port)
    return Head("http", host=host.lower().rstrip("."), port=port)


def _too_big(data: bytes, what: str) -> Head | None:
    if len(data) > MAX_HEAD_BYTES:
        return Head("bad", error=f"{what} over {MAX_HEAD_BYTES} bytes")
    return None
