"""The gateway's DNS server for a sandbox: synthetic answers, nothing forwarded.

The guest's only resolver is the gateway. A query for a name some domain rule allows is
answered with a fake address (space.node.egress.fakeip) that the gateway maps back to
the name when the guest connects; the real lookup happens then, by the gateway. Nothing
is ever forwarded upstream and no record carries data beyond that address, so DNS
cannot be used as a tunnel out of the sandbox.

The guest is hostile: ``answer`` never raises for any input bytes.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from ipaddress import IPv4Address

from mitmproxy import dns
from mitmproxy.net.dns import classes, op_codes, response_codes, types

from space.node.api import EgressEvent, EgressPolicy, normalize_name
from space.node.egress.fakeip import FakeIps

__all__ = ["MAX_UDP_QUERY_BYTES", "TTL_S", "answer"]

#: Largest query taken over UDP (RFC 1035 section 4.2.1; we offer no EDNS).
MAX_UDP_QUERY_BYTES = 512
#: TTL of a fake answer: short, so a guest soon asks again after a policy change.
TTL_S = 5
_HEADER = struct.Struct("!HHHHHH")
_QR_BIT = 1 << 15
# The answer's name is a compression pointer to the question at offset 12 (RFC 1035
# section 4.1.4), so the response stays below 512 bytes even for a 253-character name.
_A_RECORD = struct.Struct("!HHHIH")
_POINTER_TO_QUESTION = 0xC000 | _HEADER.size


def answer(
    query: bytes,
    policy: EgressPolicy,
    fake: FakeIps,
    *,
    clock: Callable[[], float] = time.time,
) -> tuple[bytes | None, EgressEvent | None]:
    """The response to one DNS query over UDP, and the audit event of its decision.

    (None, None) for bytes to drop: shorter than a header, or a response rather than a
    query. A query that cannot be served gets FORMERR (malformed, over
    MAX_UDP_QUERY_BYTES, not exactly one question) or NOTIMP (an opcode other than
    QUERY), without an event. Otherwise: REFUSED under a closed policy or for a class
    other than IN; NXDOMAIN for an invalid name or one no domain rule allows (both
    audited "deny"); for an allowed name one A record with ``fake.address_for(name)``
    and TTL_S, and NOERROR without records for every other type (audited "allow").
    ``clock`` gives the events' time (seconds since the epoch).
    """
    if len(query) < _HEADER.size or _flags(query) & _QR_BIT:
        return None, None
    header_only = _header_only(query)
    if len(query) > MAX_UDP_QUERY_BYTES:
        return _fail(header_only, response_codes.FORMERR), None
    if header_only.op_code != op_codes.QUERY:
        return _fail(header_only, response_codes.NOTIMP), None
    try:
        message = dns.Message.unpack(query)
    except (struct.error, ValueError):  # ValueError: IDNA errors escape mitmproxy
        return _fail(header_only, response_codes.FORMERR), None
    raw_name = _question_name(query)
    if len(message.questions) != 1 or raw_name is None:
        return _fail(header_only, response_codes.FORMERR), None
    # The question as the guest spelled it (case kept), not mitmproxy's IDNA decoding.
    question = dns.Question(raw_name, message.questions[0].type, message.questions[0].class_)
    message.questions = [question]
    return _decide(message, question, policy, fake, clock())


def _decide(
    message: dns.Message,
    question: dns.Question,
    policy: EgressPolicy,
    fake: FakeIps,
    now: float,
) -> tuple[bytes, EgressEvent]:
    name = normalize_name(question.name)
    host = question.name if name is None else name
    if policy.closed:
        return _fail(message, response_codes.REFUSED), _event(now, host, "deny", "egress closed")
    if question.class_ != classes.IN:
        return _fail(message, response_codes.REFUSED), _event(now, host, "deny", "class not IN")
    if name is None:
        return _fail(message, response_codes.NXDOMAIN), _event(now, host, "deny", "invalid name")
    if policy.domain_rule_for(name) is None:
        event = _event(now, name, "deny", "no rule for host")
        return _fail(message, response_codes.NXDOMAIN), event
    if question.type != types.A:
        # No AAAA (sandboxes have no IPv6) and no other types: nothing to tunnel through.
        return _pack(message.succeed([])), _event(now, name, "allow", "empty answer")
    response = _with_a_record(_pack(message.succeed([])), fake.address_for(name))
    return response, _event(now, name, "allow", "fake address")


def _flags(query: bytes) -> int:
    return int.from_bytes(query[2:4], "big")


def _header_only(query: bytes) -> dns.Message:
    """The query's header (id, opcode, flags) without any section, to answer errors."""
    return dns.Message.unpack(query[:4] + bytes(_HEADER.size - 4))


def _question_name(query: bytes) -> str | None:
    """The one question's name as sent, if it is plain: uncompressed ASCII labels.

    None for a compression pointer, a non-ASCII byte or a dot inside a label; such a
    name is no host name, and would not read back the same from mitmproxy's decoding.
    """
    labels: list[str] = []
    offset = _HEADER.size
    while offset < len(query) and (size := query[offset]) != 0:
        label = query[offset + 1 : offset + 1 + size]
        if size >= 64 or len(label) != size or not label.isascii() or b"." in label:
            return None
        labels.append(label.decode("ascii"))
        offset += 1 + size
    return ".".join(labels) if offset < len(query) else None


def _fail(message: dns.Message, code: int) -> bytes:
    response = message.fail(code)
    response.recursion_available = True
    return _pack(response)


def _pack(response: dns.Message) -> bytes:
    packed: bytes = response.packed
    return packed


def _with_a_record(response: bytes, address: IPv4Address) -> bytes:
    """``response`` (with its question, no records) plus one A record for ``address``."""
    record = _A_RECORD.pack(_POINTER_TO_QUESTION, types.A, classes.IN, TTL_S, 4)
    header = bytearray(response[: _HEADER.size])
    header[6:8] = (1).to_bytes(2, "big")  # ANCOUNT
    return bytes(header) + response[_HEADER.size :] + record + address.packed


def _event(now: float, host: str, decision: str, reason: str) -> EgressEvent:
    return EgressEvent(
        time=now,
        protocol="dns",
        host=host,
        address=None,
        port=None,
        decision=decision,
        reason=reason,
    )
