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

import dns.exception
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from space.node.api import EgressEvent, EgressPolicy, normalize_name
from space.node.egress.fakeip import FakeIps

__all__ = ["MAX_UDP_QUERY_BYTES", "TTL_S", "answer"]

#: Largest query taken over UDP (RFC 1035 section 4.2.1; we offer no EDNS).
MAX_UDP_QUERY_BYTES = 512
#: TTL of a fake answer: short, so a guest soon asks again after a policy change.
TTL_S = 5
_HEADER = struct.Struct("!HHHHHH")


def answer(
    query: bytes,
    policy: EgressPolicy,
    fake: FakeIps,
    *,
    clock: Callable[[], float] = time.time,
) -> tuple[bytes | None, EgressEvent | None]:
    """The response to one DNS query over UDP, and the audit event of its decision.

    (None, None) for bytes to drop: shorter than a header, or a response rather than a
    query. A query that cannot be served gets FORMERR (malformed, TSIG-signed: the
    gateway holds no key, over MAX_UDP_QUERY_BYTES, not exactly one question) or NOTIMP
    (an opcode other than QUERY), without an event. An EDNS query is answered without
    an OPT record. Otherwise: REFUSED under a closed policy or for a class
    other than IN; NXDOMAIN for an invalid name or one no domain rule allows (both
    audited "deny"); for an allowed name one A record with ``fake.address_for(name)``
    and TTL_S, and NOERROR without records for every other type (audited "allow").
    ``clock`` gives the events' time (seconds since the epoch).
    """
    if len(query) < _HEADER.size or _flags(query) & dns.flags.QR:
        return None, None
    if len(query) > MAX_UDP_QUERY_BYTES:
        return _fail_header(query, dns.rcode.FORMERR), None
    if dns.opcode.from_flags(_flags(query)) != dns.opcode.QUERY:
        return _fail_header(query, dns.rcode.NOTIMP), None
    try:
        # dnspython reads the whole message (trailing bytes are an error) with the
        # query's own codecs; every malformation it finds is a DNSException.
        message = dns.message.from_wire(query)
    except dns.exception.DNSException:
        return _fail_header(query, dns.rcode.FORMERR), None
    name = _question_name(query)
    if len(message.question) != 1 or name is None:
        return _fail_header(query, dns.rcode.FORMERR), None
    return _decide(message, name, policy, fake, clock())


def _decide(
    message: dns.message.Message,
    raw_name: str,
    policy: EgressPolicy,
    fake: FakeIps,
    now: float,
) -> tuple[bytes, EgressEvent]:
    question = message.question[0]
    name = normalize_name(raw_name)
    host = raw_name if name is None else name
    if policy.closed:
        return _fail(message, dns.rcode.REFUSED), _event(now, host, "deny", "egress closed")
    if question.rdclass != dns.rdataclass.IN:
        return _fail(message, dns.rcode.REFUSED), _event(now, host, "deny", "class not IN")
    if name is None:
        return _fail(message, dns.rcode.NXDOMAIN), _event(now, host, "deny", "invalid name")
    if policy.domain_rule_for(name) is None:
        event = _event(now, name, "deny", "no rule for host")
        return _fail(message, dns.rcode.NXDOMAIN), event
    response = _response(message)
    if question.rdtype != dns.rdatatype.A:
        # No AAAA (sandboxes have no IPv6) and no other types: nothing to tunnel through.
        return response.to_wire(), _event(now, name, "allow", "empty answer")
    # The owner is the question's name (case kept as sent), written as a compression
    # pointer to it (RFC 1035 section 4.1.4): a 253-character name stays below 512 bytes.
    address = str(fake.address_for(name))
    response.answer.append(dns.rrset.from_text(question.name, TTL_S, "IN", "A", address))
    return response.to_wire(), _event(now, name, "allow", "fake address")


def _flags(query: bytes) -> int:
    return int.from_bytes(query[2:4], "big")


def _question_name(query: bytes) -> str | None:
    """The one question's name as sent, if it is plain: uncompressed ASCII labels.

    None for a compression pointer, a non-ASCII byte or a dot inside a label: such a
    name is no host name (dnspython would read it; the policy should never see it).
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


def _response(message: dns.message.Message) -> dns.message.Message:
    """NOERROR with the id, opcode, RD and question of ``message``; QR and RA set."""
    response = dns.message.make_response(message, recursion_available=True)
    response.use_edns(False)  # no OPT record even if the query had one: we offer no EDNS
    return response


def _fail(message: dns.message.Message, code: dns.rcode.Rcode) -> bytes:
    response = _response(message)
    response.set_rcode(code)
    return response.to_wire()


def _fail_header(query: bytes, code: dns.rcode.Rcode) -> bytes:
    """``code`` for a query read no further than its header: its id, opcode and RD only."""
    flags = _flags(query)
    response = dns.message.Message(id=int.from_bytes(query[:2], "big"))
    response.flags = dns.flags.QR | dns.flags.RA | (flags & dns.flags.RD)
    response.set_opcode(dns.opcode.from_flags(flags))
    response.set_rcode(code)
    return response.to_wire()


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
