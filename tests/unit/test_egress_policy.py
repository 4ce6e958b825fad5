"""The egress policy model: parsing, canonical JSON, name and address rules."""

from __future__ import annotations

import copy
import socket
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network

import pytest

from space.node.api import (
    CidrRule,
    DomainRule,
    EgressPolicy,
    InvalidArgument,
    PolicyBounds,
    Verdict,
    blocked_category,
    closed_policy,
    egress_policy,
    normalize_name,
    parse_ip_literal,
)

EXAMPLE = {
    "allow": [
        {"domain": "*.example.com", "ports": [443]},
        {"domain": "pypi.org"},
        {"cidr": "203.0.113.0/24", "ports": [5432]},
    ]
}


def policy(*rules: dict[str, object]) -> EgressPolicy:
    return EgressPolicy.parse({"allow": list(rules)})


def listed(ranges: list[str], *rules: dict[str, object]) -> EgressPolicy:
    """The rules parsed within bounds whose operator listed ``ranges``."""
    return EgressPolicy.parse({"allow": list(rules)}, PolicyBounds.of(ranges))


# --- parsing and the canonical JSON form ---------------------------------------------


def test_the_example_policy_parses_into_domain_and_cidr_rules() -> None:
    parsed = EgressPolicy.parse(EXAMPLE)
    assert parsed.domains == (
        DomainRule("*.example.com", frozenset({443})),
        DomainRule("pypi.org", frozenset({80, 443})),
    )
    assert parsed.cidrs == (CidrRule(ip_network("203.0.113.0/24"), frozenset({5432})),)
    assert not parsed.closed


def test_a_rule_without_ports_defaults_to_80_and_443() -> None:
    assert policy({"cidr": "198.51.100.0/24"}).cidrs[0].ports == frozenset({80, 443})


@pytest.mark.parametrize(
    ("rule", "canonical"),
    [
        ({"domain": "PyPI.Org."}, {"domain": "pypi.org", "ports": [80, 443]}),
        (
            {"domain": "*.Example.COM", "ports": [8443, 443]},
            {"domain": "*.example.com", "ports": [443, 8443]},
        ),
        ({"domain": "api.*.example.com"}, {"domain": "api.*.example.com", "ports": [80, 443]}),
        ({"cidr": "203.0.113.7"}, {"cidr": "203.0.113.7/32", "ports": [80, 443]}),
        ({"cidr": "2001:DB8:0:0::/32", "ports": [22]}, {"cidr": "2001:db8::/32", "ports": [22]}),
        ({"ports": [5432, 1], "cidr": "10.0.0.0/08"}, {"cidr": "10.0.0.0/8", "ports": [1, 5432]}),
    ],
)
def test_to_json_is_canonical(rule: dict[str, object], canonical: dict[str, object]) -> None:
    assert policy(rule).to_json() == {"allow": [canonical]}


@pytest.mark.parametrize(
    "data",
    [
        EXAMPLE,
        {},
        {"allow": []},
        {"allow": [{"cidr": "::/0", "ports": [443]}, {"domain": "a.b.c.d.example"}]},
        {"allow": [{"cidr": "::ffff:10.0.0.0/104"}, {"cidr": "0.0.0.0/0", "ports": [65535]}]},
    ],
)
def test_parse_of_to_json_gives_back_the_same_policy(data: dict[str, object]) -> None:
    parsed = EgressPolicy.parse(data)
    assert EgressPolicy.parse(parsed.to_json()) == parsed
    assert EgressPolicy.parse(parsed.to_json()).to_json() == parsed.to_json()


def test_to_json_lists_domain_rules_before_cidr_rules() -> None:
    allow = policy({"cidr": "192.0.2.0/24"}, {"domain": "pypi.org"}).to_json()["allow"]
    assert isinstance(allow, list)
    assert [next(iter(rule)) for rule in allow] == ["domain", "cidr"]


@pytest.mark.parametrize("data", [{}, {"allow": []}])
def test_a_policy_without_rules_is_closed(data: dict[str, object]) -> None:
    assert EgressPolicy.parse(data).closed
    assert EgressPolicy.parse(data) == closed_policy()


def test_the_closed_policy_allows_nothing() -> None:
    closed = closed_policy()
    assert closed.closed and closed.to_json() == {"allow": []}
    assert closed.domain_rule_for("pypi.org") is None
    assert not closed.allows_address(ip_address("203.0.113.5"), 443).allowed


def test_limits_are_accepted_at_the_exact_boundary() -> None:
    ports = [*range(1, 32), 65535]
    big = EgressPolicy.parse({"allow": [{"domain": f"h{i}.example.com"} for i in range(256)]})
    assert len(big.domains) == 256
    assert policy({"domain": "a.example", "ports": ports}).domains[0].ports == frozenset(ports)
    longest = ".".join(["a" * 63] * 3 + ["b" * 61])  # 253 characters
    assert policy({"domain": longest + "."}).domains[0].pattern == longest


def test_policies_are_equal_by_value_and_hashable() -> None:
    first, second = EgressPolicy.parse(EXAMPLE), EgressPolicy.parse(copy.deepcopy(EXAMPLE))
    assert first == second and hash(first) == hash(second)
    assert len({first, second, closed_policy()}) == 2


# --- every refusal names the bad item -------------------------------------------------

LONG_LABEL = "a" * 64 + ".com"
LONG_NAME = ".".join(["a" * 63] * 3 + ["b" * 62])  # 254 characters


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (None, "egress policy: expected an object, got null"),
        ([], "egress policy: expected an object, got a list"),
        ("allow", "egress policy: expected an object, got a string"),
        ({"deny": []}, "egress policy: unknown key 'deny'"),
        ({"allow": None}, "allow: expected a list of rules, got null"),
        ({"allow": {"domain": "a.com"}}, "allow: expected a list of rules, got an object"),
        ({"allow": [{"domain": "a.com"}] * 257}, "allow: 257 rules, at most 256"),
    ],
)
def test_negative_a_malformed_policy_is_refused_naming_it(data: object, message: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        EgressPolicy.parse(data)
    assert caught.value.message.startswith(message)
    assert caught.value.code == "invalid_argument"


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("pypi.org", "allow[1]: expected an object with 'domain' or 'cidr', got a string"),
        ({"domain": "a.com", "cidr": "192.0.2.0/24"}, "allow[1]: give exactly one of"),
        ({"ports": [443]}, "allow[1]: give exactly one of 'domain' or 'cidr'"),
        ({"domain": "a.com", "port": 443}, "allow[1]: unknown key 'port'"),
    ],
)
def test_negative_a_malformed_rule_is_refused_naming_it(rule: object, message: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        EgressPolicy.parse({"allow": [{"domain": "ok.example"}, rule]})
    assert caught.value.message.startswith(message)


@pytest.mark.parametrize(
    ("ports", "message"),
    [
        (443, "allow[2].ports: expected a list of 1 to 32 ports, got 443"),
        ([], "allow[2].ports: expected a list of 1 to 32 ports, got []"),
        (list(range(1, 34)), "allow[2].ports: expected a list of 1 to 32 ports"),
        ([70000], "allow[2].ports[0]: 70000 is not a port (1-65535)"),
        ([443, 0], "allow[2].ports[1]: 0 is not a port (1-65535)"),
        ([65536], "allow[2].ports[0]: 65536 is not a port (1-65535)"),
        ([-1], "allow[2].ports[0]: -1 is not a port (1-65535)"),
        (["443"], "allow[2].ports[0]: '443' is not an integer port"),
        ([True], "allow[2].ports[0]: True is not an integer port"),
        ([443.0], "allow[2].ports[0]: 443.0 is not an integer port"),
        ([None], "allow[2].ports[0]: None is not an integer port"),
        ([80, 443, 80], "allow[2].ports[2]: port 80 is listed twice"),
    ],
)
def test_negative_bad_ports_are_refused_naming_the_port(ports: object, message: str) -> None:
    rules = [
        {"domain": "a.example"},
        {"domain": "b.example"},
        {"domain": "c.example", "ports": ports},
    ]
    with pytest.raises(InvalidArgument) as caught:
        EgressPolicy.parse({"allow": rules})
    assert caught.value.message.startswith(message)


@pytest.mark.parametrize(
    ("domain", "message"),
    [
        (7, "allow[0].domain: expected a string, got int"),
        (None, "allow[0].domain: expected a string, got null"),
        ("", "allow[0].domain: '' is not a valid domain name"),
        (".", "allow[0].domain: '.' is not a valid domain name"),
        ("foo*.com", "allow[0].domain: 'foo*.com' has a partial wildcard 'foo*'"),
        ("*foo.com", "allow[0].domain: '*foo.com' has a partial wildcard '*foo'"),
        ("a.f*o.com", "allow[0].domain: 'a.f*o.com' has a partial wildcard 'f*o'"),
        ("**.com", "allow[0].domain: '**.com' has a partial wildcard '**'"),
        ("1.2.3.4", "allow[0].domain: '1.2.3.4' is an IP address, not a domain; use"),
        ("0x7f000001", "allow[0].domain: '0x7f000001' is an IP address, not a domain"),
        ("[::1]", "allow[0].domain: '[::1]' is an IP address, not a domain"),
        ("fd00:ec2::254", "allow[0].domain: 'fd00:ec2::254' is an IP address"),
        (
            "bücher.de",
            "allow[0].domain: 'bücher.de' is not ASCII; give international names in punycode",
        ),
        (LONG_LABEL, f"allow[0].domain: '{LONG_LABEL}' is not a valid domain name"),
        (LONG_NAME, "allow[0].domain: '" + LONG_NAME[:60]),
        ("-a.example.com", "allow[0].domain: '-a.example.com' is not a valid domain name"),
        ("a-.example.com", "allow[0].domain: 'a-.example.com' is not a valid domain name"),
        ("under_score.com", "allow[0].domain: 'under_score.com' is not a valid domain name"),
        ("a..com", "allow[0].domain: 'a..com' is not a valid domain name"),
        ("a.com..", "allow[0].domain: 'a.com..' is not a valid domain name"),
        ("a .com", "allow[0].domain: 'a .com' is not a valid domain name"),
        ("foo.123", "allow[0].domain: 'foo.123' is not a valid domain name"),
        ("*.0x1f", "allow[0].domain: '*.0x1f' is not a valid domain name"),
    ],
)
def test_negative_bad_domains_are_refused_naming_the_domain(domain: object, message: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        policy({"domain": domain})
    assert caught.value.message.startswith(message)


@pytest.mark.parametrize(
    ("cidr", "message"),
    [
        (None, "allow[0].cidr: expected a string, got null"),
        (
            "10.1.2.3/16",
            "allow[0].cidr: '10.1.2.3/16' has host bits set; did you mean '10.1.0.0/16'?",
        ),
        (
            "2001:db8::1/32",
            "allow[0].cidr: '2001:db8::1/32' has host bits set; did you mean '2001:db8::/32'?",
        ),
        ("0xA9FEA9FE/32", "allow[0].cidr: '0xA9FEA9FE/32' is not a network like '203.0.113.0/24'"),
        ("2852039166/32", "allow[0].cidr: '2852039166/32' is not a network"),
        ("0251.0376.0251.0376/32", "allow[0].cidr: '0251.0376.0251.0376/32' is not a network"),
        ("169.254.43518/32", "allow[0].cidr: '169.254.43518/32' is not a network"),
        ("10.0.0.0/255.0.0.0", "allow[0].cidr: '10.0.0.0/255.0.0.0' is not a network"),
        ("fe80::%eth0/64", "allow[0].cidr: 'fe80::%eth0/64' is not a network"),
        ("10.0.0.0/33", "allow[0].cidr: '10.0.0.0/33' is not a network"),
        ("example.com/24", "allow[0].cidr: 'example.com/24' is not a network"),
        (" 10.0.0.0/8", "allow[0].cidr: ' 10.0.0.0/8' is not a network"),
        ("", "allow[0].cidr: '' is not a network"),
    ],
)
def test_negative_bad_cidrs_are_refused_naming_the_network(cidr: object, message: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        policy({"cidr": cidr})
    assert caught.value.message.startswith(message)


@pytest.mark.parametrize(
    ("domain", "cidr"),
    [("1.2.3.4", "1.2.3.4/32"), ("0x7f000001", "127.0.0.1/32"), ("[::1]", "::1/128")],
)
def test_negative_an_ip_address_as_domain_points_to_the_cidr_rule(domain: str, cidr: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        policy({"domain": domain})
    assert caught.value.message.endswith(f'use {{"cidr": "{cidr}"}}')


def test_negative_a_huge_bad_value_is_cut_short_in_the_message() -> None:
    with pytest.raises(InvalidArgument) as caught:
        policy({"domain": "x" * 100_000})
    assert len(caught.value.message) < 200


def test_negative_a_refused_policy_leaves_its_input_untouched() -> None:
    data = {"allow": [{"domain": "PyPI.org."}, {"cidr": "10.1.2.3/16", "ports": [443, 80]}]}
    before = copy.deepcopy(data)
    with pytest.raises(InvalidArgument, match=r"allow\[1\]\.cidr"):
        EgressPolicy.parse(data)
    assert data == before


# --- names and wildcards ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "name", "matches"),
    [
        ("*.example.com", "a.example.com", True),
        ("*.example.com", "A.Example.COM.", True),
        ("*.example.com", "example.com", False),
        ("*.example.com", "a.b.example.com", False),
        ("*.example.com", "a.example.com..", False),
        ("*.example.com", "-a.example.com", False),
        ("*.example.com", "a.example.org", False),
        ("api.*.example.com", "api.eu.example.com", True),
        ("api.*.example.com", "api.example.com", False),
        ("pypi.org", "PyPI.org.", True),
        ("pypi.org", "files.pypi.org", False),
        ("pypi.org", "pypi.org.evil.com", False),
        ("*.example", "a.b", False),
    ],
)
def test_a_wildcard_matches_exactly_one_whole_label(pattern: str, name: str, matches: bool) -> None:
    assert policy({"domain": pattern}).domains[0].matches(name) is matches


def test_domain_rule_for_picks_a_rule_on_the_port_or_on_any_port() -> None:
    rules = policy({"domain": "*.example.com", "ports": [8443]}, {"domain": "a.example.com"})
    first, second = rules.domains
    assert rules.domain_rule_for("A.example.com.") is first
    assert rules.domain_rule_for("a.example.com", 443) is second
    assert rules.domain_rule_for("b.example.com", 8443) is first
    assert rules.domain_rule_for("b.example.com", 443) is None
    assert rules.domain_rule_for("example.com") is None
    assert rules.domain_rule_for("a.example.com/x") is None


@pytest.mark.parametrize(
    ("name", "normal"),
    [
        ("Example.COM", "example.com"),
        ("example.com.", "example.com"),
        ("localhost", "localhost"),
        ("xn--bcher-kva.de", "xn--bcher-kva.de"),
        ("a-b.c0", "a-b.c0"),
        ("123.example", "123.example"),
        ("example.com..", None),
        ("", None),
        (".", None),
        ("bücher.de", None),
        ("a_b.com", None),
        ("1.2.3.4", None),
        ("169.254.43518", None),
        ("0xA9FEA9FE", None),
        ("2852039166", None),
        ("::1", None),
        ("foo.0x", None),
        (LONG_LABEL, None),
        (LONG_NAME, None),
    ],
)
def test_normalize_name_lower_cases_and_refuses_invalid_names(
    name: str, normal: str | None
) -> None:
    assert normalize_name(name) == normal


# --- IP literals in every spelling -----------------------------------------------------

METADATA_SPELLINGS = [
    "169.254.169.254",
    "2852039166",
    "0xA9FEA9FE",
    "0xa9fea9fe",
    "0251.0376.0251.0376",
    "0xa9.0xfe.0xa9.0xfe",
    "0xA9.254.0251.0xFE",
    "169.254.43518",
    "169.16689662",
    "0251.0xfe.43518",
    "0000000251.254.169.254",
    "169.254.169.254.",
    "[::ffff:169.254.169.254]",
    "::ffff:169.254.169.254",
    "::ffff:a9fe:a9fe",
    "[::a9fe:a9fe]",
    "::169.254.169.254",
    "64:ff9b::169.254.169.254",
    "64:ff9b::a9fe:a9fe",
    "2002:a9fe:a9fe::1",
    "2001:0:4136:e378:8000:63bf:5601:5601",  # Teredo, client 169.254.169.254
    "fd00:ec2::254",
    "100.100.100.200",
    "192.0.0.192",
]


@pytest.mark.parametrize("text", METADATA_SPELLINGS)
def test_the_metadata_address_is_metadata_in_every_spelling(text: str) -> None:
    address = parse_ip_literal(text)
    assert address is not None
    assert blocked_category(address) == "metadata"


@pytest.mark.parametrize(
    "text",
    [
        "example.com",
        "",
        "0x",
        "08.1.1.1",
        "256.1.1.1",
        "1.2.3.256",
        "1.16777216",
        "4294967296",
        "1.2.3.4.5",
        "1..2",
        "1.2.3.4..",
        "+1.2.3.4",
        "[1.2.3.4]",
        "[::1",
        "::g",
        "١٢٣",
        "0x" + "f" * 100,
        "9" * 5000,
    ],
)
def test_parse_ip_literal_is_none_for_what_is_not_an_address(text: str) -> None:
    assert parse_ip_literal(text) is None


INET_ATON_CASES = [
    "1.2.3.4",
    "0",
    "0x0",
    "00",
    "1",
    "4294967295",
    "0xffffffff",
    "037777777777",
    "040000000000",
    "1.16777215",
    "1.2.65535",
    "1.2.65536",
    "0x00000000000000000001",
    "000000000000000000000012",
    "0X1.0x2.0X3.4",
    "09",
    "0x.1",
    "1.2.3.4 trailing",
    "1.2.3.4\tx",
    " 1.2.3.4",
    "1.2.3.-4",
    "1.2.3",
    "a.b.c.d",
]


@pytest.mark.parametrize("text", INET_ATON_CASES)
def test_parse_ip_literal_reads_ipv4_exactly_as_inet_aton_does(text: str) -> None:
    try:
        expected: IPv4Address | None = IPv4Address(socket.inet_aton(text))
    except OSError:
        expected = None
    assert parse_ip_literal(text) == expected


def test_parse_ip_literal_drops_an_ipv6_zone_id() -> None:
    assert parse_ip_literal("fe80::1%eth0") == IPv6Address("fe80::1")
    assert parse_ip_literal("[fe80::1%25eth0]") == IPv6Address("fe80::1")


# --- blocked address categories --------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "category"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.255.254", "loopback"),
        ("::1", "loopback"),
        ("10.0.0.1", "private"),
        ("172.16.0.1", "private"),
        ("172.31.255.255", "private"),
        ("192.168.1.1", "private"),
        ("fd12:3456::1", "private"),
        ("fd00:ec2::253", "private"),
        ("169.254.0.1", "link-local"),
        ("169.254.169.253", "link-local"),
        ("fe80::1", "link-local"),
        ("100.64.0.1", "cgnat"),
        ("100.127.255.255", "cgnat"),
        ("100.100.100.201", "cgnat"),
        ("224.0.0.1", "multicast"),
        ("239.255.255.250", "multicast"),
        ("ff02::1", "multicast"),
        ("169.254.169.254", "metadata"),
        ("168.63.129.16", "metadata"),
        ("0.0.0.0", "unspecified"),
        ("0.1.2.3", "unspecified"),
        ("::", "unspecified"),
        ("255.255.255.255", "broadcast"),
        ("255.255.255.254", "reserved"),
        ("240.0.0.1", "reserved"),
        ("192.0.0.1", "reserved"),
        ("192.0.0.193", "reserved"),
        ("198.18.0.1", "reserved"),
        ("198.19.255.255", "reserved"),
        ("fec0::1", "reserved"),
        ("64:ff9b:1::a00:1", "reserved"),
        ("::ffff:0:a9fe:a9fe", "reserved"),
        ("::ffff:10.0.0.1", "private"),
        ("::127.0.0.1", "loopback"),
        ("64:ff9b::7f00:1", "loopback"),
        ("2002:a00:1::", "private"),
        ("2002:6440:1::", "cgnat"),
    ],
)
def test_blocked_addresses_fall_in_their_category(address: str, category: str) -> None:
    assert blocked_category(ip_address(address)) == category


@pytest.mark.parametrize(
    "address",
    [
        "203.0.113.5",
        "192.0.2.1",
        "198.51.100.1",
        "8.8.8.8",
        "1.1.1.1",
        "172.15.255.255",
        "172.32.0.0",
        "100.63.255.255",
        "100.128.0.0",
        "198.17.255.255",
        "198.20.0.0",
        "192.0.1.255",
        "223.255.255.255",
        "2001:db8::1",
        "2606:4700::1111",
        "::ffff:203.0.113.5",
        "64:ff9b::808:808",
        "2002:cb00:7105::1",
    ],
)
def test_ordinary_public_addresses_are_not_blocked(address: str) -> None:
    assert blocked_category(ip_address(address)) is None


# --- which addresses a policy allows ---------------------------------------------------


def verdict(rules: EgressPolicy, address: str, port: int) -> Verdict:
    return rules.allows_address(ip_address(address), port)


def test_a_public_address_needs_a_cidr_rule_with_its_port() -> None:
    rules = EgressPolicy.parse(EXAMPLE)
    assert verdict(rules, "203.0.113.5", 5432) == Verdict(True, "cidr rule 203.0.113.0/24")
    assert verdict(rules, "203.0.113.5", 443) == Verdict(False, "no rule for address")
    assert verdict(rules, "198.51.100.1", 5432) == Verdict(False, "no rule for address")


def test_a_public_address_is_allowed_in_its_ipv4_mapped_spelling() -> None:
    rules = EgressPolicy.parse(EXAMPLE)
    assert verdict(rules, "::ffff:203.0.113.5", 5432).allowed


def test_the_synthetic_dns_range_is_reserved_and_not_reachable_by_0_0_0_0() -> None:
    rules = policy({"cidr": "0.0.0.0/0"})
    assert verdict(rules, "198.18.0.1", 443) == Verdict(False, "blocked address: reserved")
    assert verdict(rules, "203.0.113.5", 443) == Verdict(True, "cidr rule 0.0.0.0/0")


@pytest.mark.parametrize(
    ("cidr", "address", "category"),
    [
        ("0.0.0.0/0", "10.1.2.3", "private"),
        ("10.0.0.0/7", "10.1.2.3", "private"),
        ("::/0", "::1", "loopback"),
        ("::/0", "::ffff:10.1.2.3", "private"),
        ("::/0", "fd12::1", "private"),
        ("240.0.0.0/4", "255.255.255.255", "broadcast"),
        ("2002::/16", "2002:a01:203::", "private"),
        ("100.0.0.0/8", "100.64.0.1", "cgnat"),
    ],
)
def test_negative_a_wide_rule_does_not_unlock_a_blocked_address(
    cidr: str, address: str, category: str
) -> None:
    rules = policy({"cidr": cidr, "ports": [5432]})
    assert verdict(rules, address, 5432) == Verdict(False, f"blocked address: {category}")


def test_a_rule_inside_the_private_range_unlocks_it_on_its_ports_only() -> None:
    rules = listed(["10.1.0.0/16"], {"cidr": "10.1.0.0/16", "ports": [5432]})
    assert verdict(rules, "10.1.2.3", 5432) == Verdict(True, "cidr rule 10.1.0.0/16")
    assert verdict(rules, "::ffff:10.1.2.3", 5432).allowed
    assert verdict(rules, "10.1.2.3", 22) == Verdict(False, "blocked address: private")
    assert verdict(rules, "10.2.0.1", 5432) == Verdict(False, "blocked address: private")


@pytest.mark.parametrize(
    ("cidr", "address"),
    [
        ("fe80::/64", "fe80::1"),
        ("10.0.0.0/8", "10.9.9.9"),
        ("100.64.0.0/10", "100.64.0.1"),
    ],
)
def test_a_rule_naming_a_whole_listed_range_unlocks_it(cidr: str, address: str) -> None:
    rules = listed([cidr], {"cidr": cidr, "ports": [8080]})
    assert verdict(rules, address, 8080) == Verdict(True, f"cidr rule {cidr}")


@pytest.mark.parametrize(
    ("cidr", "address", "category"),
    [("127.0.0.0/8", "127.0.0.1", "loopback"), ("::1/128", "::1", "loopback")],
)
def test_negative_a_rule_inside_an_unlistable_range_never_unlocks_it(
    cidr: str, address: str, category: str
) -> None:
    rules = policy({"cidr": cidr, "ports": [8080]})  # read without bounds, as a spec is
    assert verdict(rules, address, 8080) == Verdict(False, f"blocked address: {category}")


def test_negative_a_private_rule_unlocks_nothing_the_operator_has_not_listed() -> None:
    rules = policy({"cidr": "10.1.0.0/16", "ports": [5432]})  # read without bounds
    assert verdict(rules, "10.1.2.3", 5432) == Verdict(False, "blocked address: private")


@pytest.mark.parametrize(
    "cidr",
    ["169.254.169.254/32", "169.254.0.0/16", "0.0.0.0/0", "::ffff:169.254.169.254/128", "::/0"],
)
@pytest.mark.parametrize("address", ["169.254.169.254", "::ffff:a9fe:a9fe", "64:ff9b::a9fe:a9fe"])
def test_negative_metadata_is_never_unlocked(cidr: str, address: str) -> None:
    rules = policy({"cidr": cidr, "ports": [80]})
    assert verdict(rules, address, 80) == Verdict(False, "blocked address: metadata")
    assert rules.address_usable_for_domain(ip_address(address), 80).allowed is False


def test_negative_ipv6_metadata_is_never_unlocked() -> None:
    rules = policy(
        {"cidr": "fd00:ec2::254/128", "ports": [80]}, {"cidr": "fc00::/7", "ports": [80]}
    )
    assert verdict(rules, "fd00:ec2::254", 80) == Verdict(False, "blocked address: metadata")


def test_a_domain_rule_alone_allows_no_address() -> None:
    rules = policy({"domain": "pypi.org"})
    assert verdict(rules, "151.101.0.223", 443) == Verdict(False, "no rule for address")


def test_a_name_may_resolve_to_public_addresses_but_not_to_blocked_ones() -> None:
    rules = listed(
        ["10.1.0.0/16"], {"domain": "db.internal.example"}, {"cidr": "10.1.0.0/16", "ports": [5432]}
    )
    usable = rules.address_usable_for_domain
    assert usable(ip_address("203.0.113.5"), 443) == Verdict(True, "domain rule")
    assert usable(ip_address("10.9.0.1"), 5432) == Verdict(False, "blocked address: private")
    assert usable(ip_address("10.1.0.1"), 5432) == Verdict(True, "cidr rule 10.1.0.0/16")
    assert usable(ip_address("10.1.0.1"), 443) == Verdict(False, "blocked address: private")
    assert usable(ip_address("127.0.0.1"), 443) == Verdict(False, "blocked address: loopback")


def test_the_module_exports_exactly_its_contract() -> None:
    assert sorted(egress_policy.__all__) == [
        "CidrRule",
        "DomainRule",
        "EgressPolicy",
        "PolicyBounds",
        "Verdict",
        "blocked_category",
        "closed_policy",
        "normalize_name",
        "parse_ip_literal",
    ]
