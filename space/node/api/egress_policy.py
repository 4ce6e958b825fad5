"""The egress policy of a sandbox: which destinations its traffic may reach.

Every sandbox VM sits in its own network namespace whose only exit is the node's egress
gateway; the gateway asks this module whether a destination is allowed. Pure (no I/O):
the control plane imports it too, to refuse a bad policy (422) before a node sees it.

The JSON form, as the API takes it and ``EgressPolicy.to_json`` returns it::

    {"allow": [{"domain": "*.example.com", "ports": [443]},
               {"domain": "pypi.org"},
               {"cidr": "203.0.113.0/24", "ports": [5432]}]}

No rules is *closed*: no network, DNS included. Blocked addresses (``blocked_category``)
need a CIDR rule naming a network inside their very range; metadata is never reachable.
Parse errors raise ``space.node.api.errors.InvalidArgument`` naming the bad item first
(``allow[2].ports[0]: ...``).

What a tenant may name is bounded by the operator (``PolicyBounds``, issue 17): a CIDR
rule inside a private, CGNAT, ULA or link-local range only if the operator listed a range
holding it; inside loopback, multicast, unspecified, broadcast, reserved or metadata
never; a rule holding one of the host's own addresses only if so listed or wide; a wide
rule (prefix shorter than ``WIDE_PREFIX_LEN``) on ports beyond 80 and 443 only if the
operator allows it. Domain rules may not name special-use local names (``localhost``,
``*.local``, ``*.internal``...). The gateway keeps the bounds at connect as well.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

from space.node.api.errors import InvalidArgument

__all__ = [
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

Address = IPv4Address | IPv6Address
Network = IPv4Network | IPv6Network

MAX_RULES = 256
MAX_PORTS = 32
DEFAULT_PORTS = frozenset({80, 443})
#: A CIDR rule with a shorter prefix covers more than 1/256 of its family's addresses:
#: "most of the internet" (issue 17); beyond DEFAULT_PORTS it needs the operator's leave.
WIDE_PREFIX_LEN = 8
#: Blocked categories an operator may open to tenants by listing a range inside one;
#: the others (loopback, metadata, multicast, reserved...) no policy may ever name.
LISTABLE = frozenset({"private", "cgnat", "link-local"})
#: Special-use names that are never a destination on the internet (RFC 6761, 6762,
#: 8375; ICANN's ".internal"): a domain rule may not end in one. ".test" is kept, it
#: is what test worlds resolve with their own DNS.
_LOCAL_SUFFIXES = ("localhost", "localdomain", "local", "internal", "arpa", "invalid")

_LABEL_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
# WHATWG URL "ends in a number": a host whose last label is numeric is taken as IPv4,
# never looked up as a name, so we refuse it as a name too.
_NUMERIC_LABEL_RE = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")
# One part of an inet_aton(3) address: hex (0x, 1+ digits), octal (leading 0), decimal.
_V4_PART_RE = re.compile(r"0[xX]([0-9a-fA-F]+)|0([0-7]*)|([1-9][0-9]*)")
_CIDR_RE = re.compile(r"[0-9a-fA-F.:]+(?:/[0-9]{1,3})?")
_NAT64 = IPv6Network("64:ff9b::/96")
_COMPAT = IPv6Network("::/96")
# Checked in this order: metadata first, as it lies inside link-local, private, cgnat and
# reserved; broadcast before 240/4. Metadata: most clouds, AWS IPv6, Alibaba, old Oracle,
# Azure's WireServer. Reserved: 198.18.0.0/15 holds the gateway's synthetic DNS answers;
# 64:ff9b:1::/48 local-use NAT64 (RFC 8215); 100::/64 discard (RFC 6666); ::/8 the rest
# of the IPv4-embedding space once unwrapped (e.g. SIIT ::ffff:0:0/96, RFC 2765).
_BLOCKED_TABLE = """
metadata    169.254.169.254/32 fd00:ec2::254/128 100.100.100.200/32 192.0.0.192/32
metadata    168.63.129.16/32
broadcast   255.255.255.255/32
loopback    127.0.0.0/8 ::1/128
private     10.0.0.0/8 172.16.0.0/12 192.168.0.0/16 fc00::/7
link-local  169.254.0.0/16 fe80::/10
cgnat       100.64.0.0/10
multicast   224.0.0.0/4 ff00::/8
unspecified 0.0.0.0/8 ::/128
reserved    240.0.0.0/4 192.0.0.0/24 198.18.0.0/15 fec0::/10 64:ff9b:1::/48 100::/64 ::/8
"""
_BLOCKED: tuple[tuple[str, Network], ...] = tuple(
    (line.split()[0], ipaddress.ip_network(text))
    for line in _BLOCKED_TABLE.strip().splitlines()
    for text in line.split()[1:]
)


@dataclass(frozen=True)
class DomainRule:
    """Names matching ``pattern`` (lower-case; ``*`` is one whole label) on ``ports``."""

    pattern: str
    ports: frozenset[int]

    def matches(self, name: str) -> bool:
        """Whether ``name`` (any case, one trailing dot allowed) matches the pattern.

        ``*`` matches exactly one label: ``*.example.com`` matches ``a.example.com`` but
        neither ``example.com`` nor ``a.b.example.com``. An invalid name matches nothing.
        """
        normal = normalize_name(name)
        if normal is None:
            return False
        labels, wanted = normal.split("."), self.pattern.split(".")
        return len(labels) == len(wanted) and all(
            want in ("*", label) for label, want in zip(labels, wanted, strict=True)
        )


@dataclass(frozen=True)
class CidrRule:
    """Addresses in ``network`` on ``ports``."""

    network: Network
    ports: frozenset[int]


@dataclass(frozen=True)
class PolicyBounds:
    """What tenants' policies may name, as the operator set it (issue 17).

    ``operator_ranges``: networks inside private, CGNAT, ULA or link-local ranges that
    rules may name (none by default); ``allow_wide_any_port``: whether a wide rule
    (prefix shorter than WIDE_PREFIX_LEN, e.g. ``0.0.0.0/0``) may carry ports beyond 80
    and 443; ``own_addresses``: the host's own addresses, which no narrower rule may
    hold unless it lies in an operator range. The default is the strictest.
    """

    operator_ranges: tuple[Network, ...] = ()
    allow_wide_any_port: bool = False
    own_addresses: frozenset[Address] = frozenset()

    @classmethod
    def of(
        cls,
        ranges: tuple[str, ...] | list[str] = (),
        *,
        allow_wide_any_port: bool = False,
        own_addresses: frozenset[Address] = frozenset(),
    ) -> PolicyBounds:
        """Bounds from the operator's settings; InvalidArgument naming a range that is
        not a network inside a private, CGNAT, ULA or link-local range."""
        networks = []
        for text in ranges:
            network = _parse_cidr("operator range", text)
            category = _containing_category(network)
            if category not in LISTABLE:
                raise InvalidArgument(
                    f"operator range {network}: not inside a private, CGNAT, ULA or "
                    "link-local range (only those may be opened to tenants)"
                )
            networks.append(network)
        return cls(tuple(networks), allow_wide_any_port, own_addresses)

    def listed(self, network: Network) -> bool:
        """Whether ``network`` lies inside one of the operator's ranges."""
        return any(_within(network, listed) for listed in self.operator_ranges)

    def check(self, path: str, rule: CidrRule) -> None:
        """InvalidArgument naming the rule and the reason if tenants may not use it."""
        network = rule.network
        category = _containing_category(network)
        if category is not None and category not in LISTABLE:
            raise InvalidArgument(f"{path}: {network} is {_article(category)} range, never allowed")
        if category is not None and not self.listed(network):
            raise InvalidArgument(
                f"{path}: {network} is {_article(category)} range; the operator has not "
                "listed it for tenants (egress_operator_ranges)"
            )
        wide = network.prefixlen < WIDE_PREFIX_LEN
        own = sorted(str(a) for a in self.own_addresses if _holds(network, a))
        if own and not wide and not self.listed(network):
            raise InvalidArgument(f"{path}: {network} holds the host's own address {own[0]}")
        if wide and not rule.ports <= DEFAULT_PORTS and not self.allow_wide_any_port:
            extra = min(rule.ports - DEFAULT_PORTS)
            raise InvalidArgument(
                f"{path}: {network} is wider than /{WIDE_PREFIX_LEN}: only ports 80 and 443 "
                f"unless the operator allows more (egress_allow_wide_any_port); got port {extra}"
            )


@dataclass(frozen=True)
class Verdict:
    """A decision and its short reason, as the egress log shows it."""

    allowed: bool
    reason: str


@dataclass(frozen=True)
class EgressPolicy:
    """A sandbox's allow-list; build it with ``parse``. Immutable and hashable."""

    domains: tuple[DomainRule, ...] = ()
    cidrs: tuple[CidrRule, ...] = ()
    #: The bounds it was parsed within; kept at connect too (a rule unlocks a blocked
    #: address only inside an operator range), whatever built the policy.
    bounds: PolicyBounds = field(default_factory=PolicyBounds, compare=False, repr=False)

    @classmethod
    def parse(cls, data: object, bounds: PolicyBounds | None = None) -> EgressPolicy:
        """The policy of its JSON form (``{"allow": [...]}``; ``{}`` is closed).

        Raises InvalidArgument naming the bad item, e.g.
        ``allow[2].ports[0]: 70000 is not a port (1-65535)`` or a rule ``bounds``
        refuses (``allow[0].cidr: 10.0.0.0/30 is a private range; ...``). ``bounds``
        None checks the form only (a spec file read before a node's bounds apply); such
        a policy is held to the strictest bounds at connect. None is refused as data:
        callers that take None for "no network" use ``closed_policy()``.
        """
        if not isinstance(data, dict):
            raise InvalidArgument(f"egress policy: expected an object, got {_kind(data)}")
        _check_keys("egress policy", data, {"allow"})
        rules = data.get("allow", [])
        if not isinstance(rules, list):
            raise InvalidArgument(f"allow: expected a list of rules, got {_kind(rules)}")
        if len(rules) > MAX_RULES:
            raise InvalidArgument(f"allow: {len(rules)} rules, at most {MAX_RULES}")
        parsed = [_parse_rule(f"allow[{i}]", rule) for i, rule in enumerate(rules)]
        if bounds is not None:
            for i, rule in enumerate(parsed):
                if isinstance(rule, CidrRule):
                    bounds.check(f"allow[{i}].cidr", rule)
        return cls(
            domains=tuple(r for r in parsed if isinstance(r, DomainRule)),
            cidrs=tuple(r for r in parsed if isinstance(r, CidrRule)),
            bounds=bounds or PolicyBounds(),
        )

    def to_json(self) -> dict[str, object]:
        """The canonical JSON form: domain rules, then CIDR rules, ports sorted."""
        domains = [{"domain": r.pattern, "ports": sorted(r.ports)} for r in self.domains]
        cidrs = [{"cidr": str(r.network), "ports": sorted(r.ports)} for r in self.cidrs]
        return {"allow": domains + cidrs}

    @property
    def closed(self) -> bool:
        """No rules at all: the sandbox gets no network, not even DNS."""
        return not self.domains and not self.cidrs

    def domain_rule_for(self, name: str, port: int | None = None) -> DomainRule | None:
        """The first domain rule matching ``name`` on ``port`` (None: on any port)."""
        for rule in self.domains:
            if (port is None or port in rule.ports) and rule.matches(name):
                return rule
        return None

    def allows_address(self, address: Address, port: int) -> Verdict:
        """Whether the sandbox may connect to ``address``:``port`` by address.

        A public address needs a CIDR rule containing it with the port. A blocked one
        needs a CIDR rule with the port whose network lies inside the blocked range of
        the address (``0.0.0.0/0`` never unlocks ``10.1.2.3``; ``10.1.0.0/16`` does, if
        the operator listed it).
        Metadata addresses are never allowed, and a blocked address only inside one of
        the operator's ranges (``bounds``).
        """
        blocked = _blocked_range(address)
        if blocked is not None:
            return self._unlock(address, port, blocked)
        for rule in self.cidrs:
            if port in rule.ports and any(a in rule.network for a in {address, _unwrap(address)}):
                return Verdict(True, f"cidr rule {rule.network}")
        return Verdict(False, "no rule for address")

    def address_usable_for_domain(self, address: Address, port: int) -> Verdict:
        """Whether a name a domain rule allowed may be reached at ``address``:``port``.

        The gateway calls this for every address a name resolved to: public addresses
        are fine; blocked ones only if a CIDR rule unlocks them (as in allows_address).
        """
        blocked = _blocked_range(address)
        if blocked is None:
            return Verdict(True, "domain rule")
        return self._unlock(address, port, blocked)

    def _unlock(self, address: Address, port: int, blocked: tuple[str, Network]) -> Verdict:
        category, blocked_net = blocked
        if category in LISTABLE:
            for rule in self.cidrs:
                if not self.bounds.listed(rule.network):
                    continue
                if port in rule.ports and _inside(_unwrap(address), rule.network, blocked_net):
                    return Verdict(True, f"cidr rule {rule.network}")
        return Verdict(False, f"blocked address: {category}")


def closed_policy() -> EgressPolicy:
    """The policy without rules: no network, DNS included."""
    return EgressPolicy()


def blocked_category(address: Address) -> str | None:
    """Why ``address`` is not an ordinary public destination, or None if it is.

    One of "metadata", "broadcast", "loopback", "private", "link-local", "cgnat",
    "multicast", "unspecified", "reserved". IPv4 embedded in IPv6 (mapped, compatible,
    NAT64, 6to4, Teredo client) is classified as that IPv4 address.
    """
    blocked = _blocked_range(address)
    return None if blocked is None else blocked[0]


def normalize_name(name: str) -> str | None:
    """``name`` lower-cased without one trailing dot, or None if not a valid DNS name.

    Labels are 1-63 of ``[a-z0-9-]``, not starting or ending with ``-``; at most 253 in
    all. Non-ASCII (give IDNs in punycode), IP literals, and names whose last label is
    numeric (``foo.123``, which URL parsers take for IPv4) are None.
    """
    if not name.isascii():
        return None
    normal = name.lower().removesuffix(".")
    if not 0 < len(normal) <= 253:
        return None
    labels = normal.split(".")
    if not all(_LABEL_RE.fullmatch(label) for label in labels):
        return None
    if _NUMERIC_LABEL_RE.fullmatch(labels[-1]):
        return None  # covers every IPv4 literal too: its last part is a number
    return normal


def parse_ip_literal(text: str) -> Address | None:
    """The address ``text`` spells, or None if it is not an IP literal.

    IPv6 with or without brackets (a zone id is dropped); IPv4 in every form inet_aton(3)
    accepts: 1 to 4 parts, each decimal, octal (``0251``) or hex (``0xa9``), the last
    filling the remaining bytes (``169.254.43518``, ``2852039166``), and, as glibc does,
    anything after a whitespace ignored. One trailing dot is accepted, as URL parsers do.
    """
    if not text.isascii():
        return None
    if text.startswith("[") and text.endswith("]"):
        return _parse_v6(text[1:-1])
    v6 = _parse_v6(text) if ":" in text else None
    if v6 is not None:
        return v6
    head = re.split(r"[ \t\n\v\f\r]", text, maxsplit=1)[0]  # glibc stops at a space
    return _parse_inet_aton(head.removesuffix("."))


def _parse_v6(text: str) -> IPv6Address | None:
    try:
        address = IPv6Address(text)
    except ValueError:
        return None
    return IPv6Address(int(address))  # without its zone id


def _parse_inet_aton(text: str) -> IPv4Address | None:
    values = [_v4_part(part) for part in text.split(".")]
    if len(values) > 4 or None in values:
        return None
    *head, last = [v for v in values if v is not None]
    last_bits = 8 * (5 - len(values))
    if any(v > 255 for v in head) or last >= 1 << last_bits:
        return None
    return IPv4Address(int.from_bytes(bytes(head), "big") << last_bits | last)


def _v4_part(part: str) -> int | None:
    match = _V4_PART_RE.fullmatch(part)
    if match is None or match.lastindex is None:
        return None
    # Leading zeros are free (as in strtoul); 11 digits in any base here exceed 32 bits.
    digits = match[match.lastindex].lstrip("0") or "0"
    return 1 << 40 if len(digits) > 11 else int(digits, (16, 8, 10)[match.lastindex - 1])


def _unwrap(address: Address) -> Address:
    """The IPv4 address embedded in ``address``, or ``address`` itself."""
    if isinstance(address, IPv4Address):
        return address
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    low = IPv4Address(int(address) & 0xFFFFFFFF)
    if address in _NAT64 or (address in _COMPAT and int(address) > 1):
        return low  # "::" and "::1" are themselves, not 0.0.0.0 and 0.0.0.1
    return address


def _blocked_range(address: Address) -> tuple[str, Network] | None:
    inner = _unwrap(address)
    for category, network in _BLOCKED:
        if inner in network:
            return category, network
    return None


def _within(inner: Network, outer: Network) -> bool:
    return inner.version == outer.version and inner.subnet_of(outer)  # type: ignore[arg-type]


def _holds(network: Network, address: Address) -> bool:
    return network.version == address.version and address in network


def _containing_category(network: Network) -> str | None:
    """The category of the first blocked range that holds all of ``network`` (metadata
    first), or None. IPv6 rules embedding IPv4 fall in ``::/8`` or stay IPv6: a rule of
    one family never unlocks an address of the other (``_inside``)."""
    for category, blocked in _BLOCKED:
        if _within(network, blocked):
            return category
    return None


def _article(category: str) -> str:
    return f"an {category}" if category[0] in "aeiou" else f"a {category}"


def _inside(address: Address, rule: Network, blocked: Network) -> bool:
    """Whether ``rule`` contains ``address`` and lies inside the ``blocked`` range."""
    if rule.version != blocked.version or address not in rule:
        return False
    first, last = int(rule.network_address), int(rule.broadcast_address)
    return int(blocked.network_address) <= first and last <= int(blocked.broadcast_address)


def _parse_rule(path: str, rule: object) -> DomainRule | CidrRule:
    if not isinstance(rule, dict):
        raise InvalidArgument(
            f"{path}: expected an object with 'domain' or 'cidr', got {_kind(rule)}"
        )
    _check_keys(path, rule, {"domain", "cidr", "ports"})
    if ("domain" in rule) == ("cidr" in rule):
        raise InvalidArgument(f"{path}: give exactly one of 'domain' or 'cidr'")
    ports = _parse_ports(f"{path}.ports", rule.get("ports", sorted(DEFAULT_PORTS)))
    if "domain" in rule:
        return DomainRule(_parse_pattern(f"{path}.domain", rule["domain"]), ports)
    return CidrRule(_parse_cidr(f"{path}.cidr", rule["cidr"]), ports)


def _parse_ports(path: str, ports: object) -> frozenset[int]:
    if not isinstance(ports, list) or not 1 <= len(ports) <= MAX_PORTS:
        got = _show(ports)
        raise InvalidArgument(f"{path}: expected a list of 1 to {MAX_PORTS} ports, got {got}")
    for i, port in enumerate(ports):
        if not isinstance(port, int) or isinstance(port, bool):
            raise InvalidArgument(f"{path}[{i}]: {_show(port)} is not an integer port")
        if not 1 <= port <= 65535:
            raise InvalidArgument(f"{path}[{i}]: {port} is not a port (1-65535)")
        if port in ports[:i]:
            raise InvalidArgument(f"{path}[{i}]: port {port} is listed twice")
    return frozenset(ports)


def _parse_pattern(path: str, pattern: object) -> str:
    if not isinstance(pattern, str):
        raise InvalidArgument(f"{path}: expected a string, got {_kind(pattern)}")
    if not pattern.isascii():
        why = "is not ASCII; give international names in punycode (xn--...)"
        raise InvalidArgument(f"{path}: {_show(pattern)} {why}")
    address = parse_ip_literal(pattern)
    if address is not None:
        raise InvalidArgument(
            f"{path}: {_show(pattern)} is an IP address, not a domain; "
            f'use {{"cidr": "{address}/{address.max_prefixlen}"}}'
        )
    partial = [label for label in pattern.split(".") if "*" in label and label != "*"]
    if partial:
        why = f"has a partial wildcard {partial[0]!r}; '*' must be a whole label"
        raise InvalidArgument(f"{path}: {_show(pattern)} {why}")
    # Checked as a name with each '*' label standing in for one ordinary label.
    stand_in = ".".join("x" if label == "*" else label for label in pattern.split("."))
    if normalize_name(stand_in) is None:
        raise InvalidArgument(f"{path}: {_show(pattern)} is not a valid domain name")
    normal = pattern.lower().removesuffix(".")
    _check_not_local(path, normal)
    return normal


def _check_not_local(path: str, pattern: str) -> None:
    """Refuse a pattern under a special-use suffix: it names no host on the internet.
    (A wildcard one, ``*.*``, may match local names too; what they resolve to is
    refused at connect like any blocked address.)"""
    last = pattern.rsplit(".", 1)[-1]
    if last in _LOCAL_SUFFIXES:
        raise InvalidArgument(f"{path}: {pattern!r} names no internet host ('.{last}' is local)")


def _parse_cidr(path: str, text: object) -> Network:
    if not isinstance(text, str):
        raise InvalidArgument(f"{path}: expected a string, got {_kind(text)}")
    bad = f"{path}: {_show(text)} is not a network like '203.0.113.0/24' or '2001:db8::/32'"
    # The canonical spellings only: no hex or octal parts, netmasks or zone ids.
    if not _CIDR_RE.fullmatch(text):
        raise InvalidArgument(bad)
    try:
        network = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise InvalidArgument(bad) from None
    if ipaddress.ip_address(text.partition("/")[0]) != network.network_address:
        raise InvalidArgument(f"{path}: {_show(text)} has host bits set; did you mean '{network}'?")
    return network


def _check_keys(path: str, data: dict[object, object], allowed: set[str]) -> None:
    unknown = sorted(str(key) for key in data if key not in allowed)
    if unknown:
        known = ", ".join(sorted(allowed))
        raise InvalidArgument(f"{path}: unknown key {unknown[0]!r} (allowed: {known})")


def _kind(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _show(value: object) -> str:
    """``repr(value)`` cut short, so a huge value does not flood an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
