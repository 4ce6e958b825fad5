"""The gateway's DNS answers: fake addresses for allowed names, nothing else, ever."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from dns.edns import CookieOption
from dns.message import from_wire, make_query
from dns.rcode import NXDOMAIN
from dns.tsigkeyring import from_text
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import dns
from mitmproxy.net.dns import classes, op_codes, response_codes, types

from space.node.api import EgressEvent, EgressPolicy, closed_policy
from space.node.egress.audit import AuditLog
from space.node.egress.connection import Tracker
from space.node.egress.dns import MAX_UDP_QUERY_BYTES, TTL_S, answer
from space.node.egress.fakeip import FakeIps
from space.node.egress.gateway import _DnsResponder

POLICY = EgressPolicy.parse(
    {"allow": [{"domain": "*.example.com"}, {"domain": "pypi.org"}, {"domain": "xn--bcher-kva.de"}]}
)
NOW = 1700000000.25


def _query(
    name: str = "api.example.com",
    qtype: int = types.A,
    *,
    qclass: int = classes.IN,
    id: int = 4660,
    op_code: int = op_codes.QUERY,
    questions: list[dns.Question] | None = None,
    additionals: list[dns.ResourceRecord] | None = None,
) -> bytes:
    message = dns.Message(
        timestamp=0.0,
        id=id,
        query=True,
        op_code=op_code,
        authoritative_answer=False,
        truncation=False,
        recursion_desired=True,
        recursion_available=False,
        reserved=0,
        response_code=response_codes.NOERROR,
        questions=[dns.Question(name, qtype, qclass)] if questions is None else questions,
        answers=[],
        authorities=[],
        additionals=additionals or [],
    )
    packed: bytes = message.packed
    return packed


def _ask(
    query: bytes, policy: EgressPolicy = POLICY, fake: FakeIps | None = None
) -> tuple[dns.Message, EgressEvent | None]:
    response, event = answer(
        query, policy, fake if fake is not None else FakeIps(), clock=lambda: NOW
    )
    assert response is not None
    return dns.Message.unpack(response), event


def _dns_event(host: str, decision: str, reason: str) -> EgressEvent:
    return EgressEvent(NOW, "dns", host, None, None, decision, reason)


def _header(flags: int, qdcount: int = 1) -> bytes:
    return struct.pack("!HHHHHH", 4660, flags, qdcount, 0, 0, 0)


def test_an_allowed_name_gets_one_a_record_with_its_fake_address() -> None:
    fake = FakeIps()
    response, event = _ask(_query("api.example.com"), fake=fake)
    assert response.response_code == response_codes.NOERROR
    (record,) = response.answers
    assert (record.name, record.type, record.class_, record.ttl) == (
        "api.example.com",
        types.A,
        classes.IN,
        TTL_S,
    )
    assert fake.name_for(record.ipv4_address) == "api.example.com"
    assert event == _dns_event("api.example.com", "allow", "fake address")


def test_the_response_copies_id_question_and_rd_and_sets_qr_and_ra() -> None:
    response, _ = _ask(_query("Api.EXAMPLE.com", id=65535))
    assert response.id == 65535
    assert not response.query
    assert response.recursion_available
    assert response.recursion_desired
    assert not response.authoritative_answer
    # Case kept as sent: resolvers using 0x20 randomisation compare it.
    assert response.questions == [dns.Question("Api.EXAMPLE.com", types.A, classes.IN)]
    assert response.answers[0].name == "Api.EXAMPLE.com"


def test_asking_twice_gives_the_same_address_and_case_does_not_matter() -> None:
    fake = FakeIps()
    first, _ = _ask(_query("api.example.com"), fake=fake)
    second, event = _ask(_query("API.Example.COM"), fake=fake)
    assert first.answers[0].data == second.answers[0].data
    assert len(fake) == 1
    assert event is not None and event.host == "api.example.com"


def test_a_wildcard_rule_matches_exactly_one_label() -> None:
    fake = FakeIps()
    allowed, _ = _ask(_query("a.example.com"), fake=fake)
    assert len(allowed.answers) == 1
    for name in ("example.com", "a.b.example.com"):
        denied, event = _ask(_query(name), fake=fake)
        assert denied.response_code == response_codes.NXDOMAIN
        assert event == _dns_event(name, "deny", "no rule for host")
    assert len(fake) == 1


def test_negative_a_name_without_a_rule_is_nxdomain_and_audited() -> None:
    fake = FakeIps()
    response, event = _ask(_query("evil.org"), fake=fake)
    assert response.response_code == response_codes.NXDOMAIN
    assert response.answers == []
    assert response.questions == [dns.Question("evil.org", types.A, classes.IN)]
    assert event == _dns_event("evil.org", "deny", "no rule for host")
    assert len(fake) == 0


@pytest.mark.parametrize("name", ["under_score.example.com", "192.168.0.1", "x.123", ""])
def test_negative_an_invalid_name_is_nxdomain(name: str) -> None:
    fake = FakeIps()
    response, event = _ask(_query(name), fake=fake)
    assert response.response_code == response_codes.NXDOMAIN
    assert response.answers == []
    assert event == _dns_event(name, "deny", "invalid name")
    assert len(fake) == 0


@pytest.mark.parametrize(
    "qtype", [types.AAAA, types.TXT, types.MX, types.ANY, types.HTTPS, types.SRV, types.CNAME]
)
def test_other_types_of_an_allowed_name_get_noerror_without_records(qtype: int) -> None:
    fake = FakeIps()
    response, event = _ask(_query("api.example.com", qtype), fake=fake)
    assert response.response_code == response_codes.NOERROR
    assert (response.answers, response.authorities, response.additionals) == ([], [], [])
    assert response.questions == [dns.Question("api.example.com", qtype, classes.IN)]
    assert event == _dns_event("api.example.com", "allow", "empty answer")
    assert len(fake) == 0


@pytest.mark.parametrize(("name", "qtype"), [("api.example.com", types.A), ("x.org", types.TXT)])
def test_negative_a_closed_policy_refuses_everything(name: str, qtype: int) -> None:
    fake = FakeIps()
    response, event = _ask(_query(name, qtype), policy=closed_policy(), fake=fake)
    assert response.response_code == response_codes.REFUSED
    assert response.answers == []
    assert event == _dns_event(name, "deny", "egress closed")
    assert len(fake) == 0


@pytest.mark.parametrize("qclass", [classes.CH, classes.HS, classes.ANY])
def test_negative_a_class_other_than_in_is_refused(qclass: int) -> None:
    fake = FakeIps()
    response, event = _ask(_query("api.example.com", qclass=qclass), fake=fake)
    assert response.response_code == response_codes.REFUSED
    assert event == _dns_event("api.example.com", "deny", "class not IN")
    assert len(fake) == 0


def test_a_punycode_name_is_taken_as_sent() -> None:
    response, event = _ask(_query("XN--BCHER-KVA.de"))
    assert len(response.answers) == 1
    assert event is not None and event.host == "xn--bcher-kva.de"


def test_a_253_character_name_gets_an_answer_within_512_bytes() -> None:
    name = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
    assert len(name) == 253
    policy = EgressPolicy.parse({"allow": [{"domain": name}]})
    raw, _ = answer(_query(name), policy, FakeIps())
    assert raw is not None and len(raw) <= 512
    response = dns.Message.unpack(raw)
    assert response.answers[0].name == name


def test_a_query_of_exactly_512_bytes_is_answered() -> None:
    small = _query(additionals=[dns.ResourceRecord("", 41, 512, 0, b"")])
    padding = b"\0" * (MAX_UDP_QUERY_BYTES - len(small))
    query = _query(additionals=[dns.ResourceRecord("", 41, 512, 0, padding)])
    assert len(query) == MAX_UDP_QUERY_BYTES
    response, _ = _ask(query)
    assert len(response.answers) == 1
    assert response.additionals == []


def test_negative_a_query_over_512_bytes_is_formerr_without_event() -> None:
    small = _query(additionals=[dns.ResourceRecord("", 41, 512, 0, b"")])
    padding = b"\0" * (MAX_UDP_QUERY_BYTES + 1 - len(small))
    fake = FakeIps()
    response, event = _ask(
        _query(additionals=[dns.ResourceRecord("", 41, 512, 0, padding)]), fake=fake
    )
    assert response.response_code == response_codes.FORMERR
    assert response.id == 4660
    assert response.questions == []
    assert event is None
    assert len(fake) == 0


@pytest.mark.parametrize(
    "op_code", [op_codes.IQUERY, op_codes.STATUS, op_codes.NOTIFY, op_codes.UPDATE, 15]
)
def test_negative_an_opcode_other_than_query_is_notimp(op_code: int) -> None:
    response, event = _ask(_query(op_code=op_code))
    assert response.response_code == response_codes.NOTIMP
    assert response.op_code == op_code
    assert response.id == 4660
    assert event is None


@pytest.mark.parametrize("count", [0, 2])
def test_negative_not_exactly_one_question_is_formerr(count: int) -> None:
    questions = [dns.Question(f"q{i}.example.com", types.A, classes.IN) for i in range(count)]
    fake = FakeIps()
    response, event = _ask(_query(questions=questions), fake=fake)
    assert response.response_code == response_codes.FORMERR
    assert response.questions == []
    assert event is None
    assert len(fake) == 0


@pytest.mark.parametrize(
    "query",
    [
        _query()[:-1],  # truncated question
        _query() + b"\0",  # trailing garbage
        _header(0x0100) + b"\x03a.b\x07example\x03com\x00" + struct.pack("!HH", 1, 1),
        _header(0x0100) + b"\x03\xff\xfe\xfd\x03com\x00" + struct.pack("!HH", 1, 1),
        _header(0x0100) + b"\xc0\x0c" + struct.pack("!HH", 1, 1),  # pointer loop
        _header(0x0100) + b"\x40" + b"a" * 64 + b"\x00" + struct.pack("!HH", 1, 1),
        _header(0x0100, qdcount=65535),
    ],
    ids=[
        "truncated",
        "trailing",
        "dot-in-label",
        "non-ascii",
        "loop",
        "long-label",
        "counts",
    ],
)
def test_negative_a_malformed_query_with_a_header_is_formerr(query: bytes) -> None:
    fake = FakeIps()
    response, event = _ask(query, fake=fake)
    assert response.response_code == response_codes.FORMERR
    assert response.id == 4660
    assert not response.query
    assert event is None
    assert len(fake) == 0


def test_a_label_that_is_no_valid_punycode_is_taken_as_sent_too() -> None:
    # No IDNA decoding anywhere (mitmproxy's codec raised on this one): plain ASCII.
    query = _header(0x0100) + b"\x06xn--zz\x03com\x00" + struct.pack("!HH", 1, 1)
    raw, event = answer(query, POLICY, FakeIps(), clock=lambda: NOW)
    assert raw is not None
    assert from_wire(raw).rcode() == NXDOMAIN
    assert event == _dns_event("xn--zz.com", "deny", "no rule for host")


def test_an_edns_query_with_options_gets_an_answer_without_an_opt_record() -> None:
    query = make_query(
        "Api.Example.com", "A", use_edns=0, pad=128, options=[CookieOption(b"8 bytes!", b"")]
    )
    raw, event = answer(query.to_wire(), POLICY, FakeIps(), clock=lambda: NOW)
    assert raw is not None
    response = from_wire(raw)
    assert query.is_response(response)
    assert response.edns == -1 and response.additional == []
    assert [str(rrset.name) for rrset in response.answer] == ["Api.Example.com."]
    assert event == _dns_event("api.example.com", "allow", "fake address")


def test_negative_a_signed_query_is_formerr_without_event() -> None:
    # The gateway holds no TSIG key, so a signed query cannot be checked.
    query = make_query("api.example.com", "A")
    query.use_tsig(from_text({"k.": "MTIzNDU2Nzg5MDEyMzQ1Ng=="}), "k.")
    response, event = _ask(query.to_wire())
    assert response.response_code == response_codes.FORMERR
    assert event is None


def test_negative_a_compressed_question_name_is_formerr() -> None:
    # The question points forward at a name kept in an additional record's rdata.
    name = b"\x03api\x07example\x03com\x00"
    question = b"\xc0\x1d" + struct.pack("!HH", types.A, classes.IN)
    record = b"\x00" + struct.pack("!HHIH", 99, classes.IN, 0, len(name)) + name
    query = struct.pack("!HHHHHH", 4660, 0x0100, 1, 0, 0, 1) + question + record
    assert 12 + len(question) + 11 == 0x1D
    assert dns.Message.unpack(query).questions[0].name == "api.example.com"
    response, event = _ask(query)
    assert response.response_code == response_codes.FORMERR
    assert event is None


@pytest.mark.parametrize(
    "query", [b"", b"\x12\x34", bytes(11), _header(0x8100), _header(0x8000) + b"junk"]
)
def test_negative_bytes_without_a_header_or_with_qr_set_are_dropped(query: bytes) -> None:
    fake = FakeIps()
    assert answer(query, POLICY, fake) == (None, None)
    assert len(fake) == 0


def test_negative_a_response_to_an_allowed_name_is_dropped() -> None:
    response, _ = answer(_query(), POLICY, FakeIps())
    assert response is not None
    assert answer(response, POLICY, FakeIps()) == (None, None)


def _check_any_outcome(data: bytes) -> None:
    response, event = answer(data, POLICY, FakeIps())
    if response is None:
        assert event is None
        return
    message = dns.Message.unpack(response)
    assert not message.query
    assert message.id == int.from_bytes(data[:2], "big")
    assert len(response) <= MAX_UDP_QUERY_BYTES
    assert len(message.answers) <= 1


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    _check_any_outcome(data)


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(
        [
            _query(),
            _query("a.b.example.com", types.TXT),
            _query(additionals=[dns.ResourceRecord("", 41, 512, 0, b"x")]),
        ]
    ),
    st.lists(st.tuples(st.integers(0, 600), st.integers(0, 255)), max_size=6),
    st.integers(0, 64),
)
def test_mutated_queries_never_raise(base: bytes, edits: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(base)
    for position, value in edits:
        if position < len(data):
            data[position] = value
    _check_any_outcome(bytes(data[: len(data) - cut]))


def test_a_refusal_is_audited_before_the_guest_hears_it(tmp_path: Path) -> None:
    """The gateway's responder: a guest that reads its egress log as soon as it has
    the answer finds the refusal there (it was written after the reply, and a loaded
    host let a test read first)."""
    audit = AuditLog(tmp_path)
    tracker = cast(Tracker, SimpleNamespace(sandbox_id="sb-1", policy=POLICY))
    responder = _DnsResponder(tracker, FakeIps(), audit)
    logged_at_reply: list[list[EgressEvent]] = []

    class Transport:
        def sendto(self, data: bytes, addr: object) -> None:
            logged_at_reply.append(audit.read("sb-1"))

    responder.connection_made(cast(asyncio.BaseTransport, Transport()))
    responder.datagram_received(_query("tunnel.evil.test"), ("10.0.0.2", 5353))
    ((event,),) = logged_at_reply
    assert (event.host, event.decision, event.reason) == (
        "tunnel.evil.test", "deny", "no rule for host",
    )  # fmt: skip
