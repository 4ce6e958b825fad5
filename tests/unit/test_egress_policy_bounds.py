"""What a tenant's egress policy may name (issue 17, probe 7): the operator's bounds."""

from __future__ import annotations

from ipaddress import IPv4Address, ip_address, ip_network
from pathlib import Path

import pytest
from click.testing import CliRunner

from space.cli import main
from space.control.settings import ControlSettings
from space.node.api import CidrRule, EgressPolicy, InvalidArgument, PolicyBounds, Verdict
from space.node.core.config import NodeConfig

STRICT = PolicyBounds()


def parse(bounds: PolicyBounds, *rules: dict[str, object]) -> EgressPolicy:
    return EgressPolicy.parse({"allow": list(rules)}, bounds)


def refusal(bounds: PolicyBounds, rule: dict[str, object]) -> str:
    with pytest.raises(InvalidArgument) as caught:
        parse(bounds, rule)
    return caught.value.message


def test_negative_a_private_30_is_refused_unless_the_operator_listed_it() -> None:
    rule: dict[str, object] = {"cidr": "10.254.77.0/30", "ports": [80]}
    assert refusal(STRICT, rule) == (
        "allow[0].cidr: 10.254.77.0/30 is a private range; the operator has not listed it"
        " for tenants (egress_operator_ranges)"
    )
    assert parse(PolicyBounds.of(["10.254.77.0/24"]), rule).cidrs[0].network == ip_network(
        "10.254.77.0/30"
    )
    assert parse(PolicyBounds.of(["10.254.77.0/30"]), rule).to_json() == {"allow": [rule]}


def test_negative_a_rule_wider_than_the_operators_range_is_refused() -> None:
    bounds = PolicyBounds.of(["10.254.77.0/30"])
    assert "is a private range" in refusal(bounds, {"cidr": "10.254.77.0/29"})
    assert "is a private range" in refusal(bounds, {"cidr": "10.254.78.0/30"})


@pytest.mark.parametrize(
    ("cidr", "category"),
    [
        ("192.168.1.0/24", "private"),
        ("172.16.0.0/12", "private"),
        ("169.254.0.0/16", "link-local"),
        ("169.254.1.0/24", "link-local"),
        ("100.64.0.0/10", "cgnat"),
        ("100.100.0.0/16", "cgnat"),
        ("fc00::/7", "private"),
        ("fd00::/8", "private"),
        ("fd12:3456::/32", "private"),
        ("fe80::/64", "link-local"),
    ],
)
def test_negative_listable_ranges_are_refused_by_default(cidr: str, category: str) -> None:
    assert f"{cidr} is a {category} range; the operator has not listed it" in refusal(
        STRICT, {"cidr": cidr}
    )


@pytest.mark.parametrize(
    ("cidr", "category"),
    [
        ("127.0.0.0/8", "loopback"),
        ("127.0.0.1/32", "loopback"),
        ("::1/128", "loopback"),
        ("169.254.169.254/32", "metadata"),
        ("fd00:ec2::254/128", "metadata"),
        ("224.0.0.0/4", "multicast"),
        ("0.0.0.0/8", "unspecified"),
        ("198.18.0.0/15", "reserved"),
        ("::ffff:10.0.0.0/104", "reserved"),
        ("255.255.255.255/32", "broadcast"),
    ],
)
def test_negative_unlistable_ranges_are_refused_whatever_the_operator_listed(
    cidr: str, category: str
) -> None:
    everything = PolicyBounds.of(["10.0.0.0/8", "169.254.0.0/16", "fc00::/7", "100.64.0.0/10"])
    message = refusal(everything, {"cidr": cidr})
    assert message.endswith("range, never allowed") and category in message


@pytest.mark.parametrize(
    "text", ["203.0.113.0/24", "127.0.0.0/8", "0.0.0.0/0", "169.254.169.254/32", "10.0.0.0/7"]
)
def test_negative_an_operator_range_outside_the_listable_ranges_is_refused(text: str) -> None:
    with pytest.raises(InvalidArgument, match="not inside a private, CGNAT, ULA or link-local"):
        PolicyBounds.of([text])


def test_negative_metadata_stays_blocked_inside_a_listed_link_local_range() -> None:
    rules = parse(PolicyBounds.of(["169.254.0.0/16"]), {"cidr": "169.254.0.0/16", "ports": [80]})
    assert rules.allows_address(ip_address("169.254.1.1"), 80).allowed
    meta = rules.allows_address(ip_address("169.254.169.254"), 80)
    assert meta == Verdict(False, "blocked address: metadata")


@pytest.mark.parametrize("cidr", ["0.0.0.0/0", "::/0", "0.0.0.0/1", "2000::/3", "8.0.0.0/7"])
def test_negative_a_wide_rule_beyond_ports_80_and_443_needs_the_operators_leave(cidr: str) -> None:
    rule: dict[str, object] = {"cidr": cidr, "ports": [443, 22]}
    message = refusal(STRICT, rule)
    assert message == (
        f"allow[0].cidr: {cidr} is wider than /8: only ports 80 and 443 unless the operator"
        " allows more (egress_allow_wide_any_port); got port 22"
    )
    assert parse(PolicyBounds(allow_wide_any_port=True), rule).cidrs[0].ports == {22, 443}


@pytest.mark.parametrize("cidr", ["0.0.0.0/0", "::/0"])
def test_a_wide_rule_on_the_default_ports_is_accepted(cidr: str) -> None:
    rules = parse(STRICT, {"cidr": cidr}, {"cidr": cidr, "ports": [443]})
    assert rules.allows_address(ip_address("203.0.113.5" if "." in cidr else "2001:db8::1"), 80)


def test_a_slash_8_is_not_wide_and_may_name_any_port() -> None:
    assert parse(STRICT, {"cidr": "8.0.0.0/8", "ports": [22]}).cidrs[0].ports == {22}


def test_negative_a_rule_holding_the_nodes_own_address_is_refused_unless_wide_or_listed() -> None:
    own = frozenset({IPv4Address("203.0.113.7"), IPv4Address("10.254.77.1")})
    bounds = PolicyBounds.of(["10.254.77.0/30"], own_addresses=own)
    for cidr in ("203.0.113.7/32", "203.0.113.0/24"):
        message = refusal(bounds, {"cidr": cidr})
        assert message == f"allow[0].cidr: {cidr} holds the host's own address 203.0.113.7"
    assert parse(bounds, {"cidr": "0.0.0.0/0"}, {"cidr": "10.254.77.0/30"}).cidrs


@pytest.mark.parametrize(
    "domain",
    [
        "localhost",
        "LocalHost.",
        "*.localhost",
        "a.localhost",
        "printer.local",
        "*.local",
        "db.internal",
        "host.localdomain",
        "1.0.0.127.in-addr.arpa",
        "router.home.arpa",
        "x.invalid",
    ],
)
def test_negative_a_domain_rule_naming_local_names_is_refused(domain: str) -> None:
    with pytest.raises(InvalidArgument, match=r"allow\[0\]\.domain: .* names no internet host"):
        EgressPolicy.parse({"allow": [{"domain": domain}]})


@pytest.mark.parametrize(
    "domain", ["127.0.0.1", "0x7f.1", "[::1]", "10.254.77.1", "169.254.169.254"]
)
def test_negative_a_domain_rule_that_is_an_ip_literal_is_refused(domain: str) -> None:
    with pytest.raises(InvalidArgument, match="is an IP address, not a domain"):
        EgressPolicy.parse({"allow": [{"domain": domain}]}, STRICT)


def test_negative_the_gateway_keeps_the_bounds_at_connect_for_a_policy_built_without_them() -> None:
    unchecked = EgressPolicy(cidrs=(CidrRule(ip_network("10.254.77.0/30"), frozenset({80})),))
    assert unchecked.allows_address(ip_address("10.254.77.2"), 80) == Verdict(
        False, "blocked address: private"
    )
    assert not unchecked.address_usable_for_domain(ip_address("10.254.77.2"), 80).allowed


def test_negative_a_domain_resolving_to_a_blocked_address_stays_refused_at_connect() -> None:
    rules = parse(STRICT, {"domain": "example.com"})
    for address in ("10.254.77.2", "127.0.0.1", "169.254.169.254", "100.64.0.1", "fd00::1"):
        assert not rules.address_usable_for_domain(ip_address(address), 443).allowed


def test_negative_node_and_control_settings_refuse_a_bad_operator_range(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"operator range 203\.0\.113\.0/24"):
        NodeConfig(egress_operator_ranges=("203.0.113.0/24",))
    with pytest.raises(InvalidArgument, match="operator range"):
        ControlSettings(data_dir=tmp_path, egress_operator_ranges=("nonsense",))


def test_node_config_carries_the_operators_bounds() -> None:
    config = NodeConfig(egress_operator_ranges=("10.254.77.0/30",), egress_allow_wide_any_port=True)
    assert config.egress_bounds == PolicyBounds((ip_network("10.254.77.0/30"),), True)


@pytest.mark.parametrize("command", ["serve", "node"])
def test_negative_a_server_refuses_a_public_operator_range_before_starting_anything(
    tmp_path: Path, command: str
) -> None:
    data_dir = tmp_path / "data"
    args = [command, "--data-dir", str(data_dir), "--egress-allow-range", "203.0.113.0/24"]
    if command == "node":
        token = tmp_path / "token"
        token.write_text("t" * 32)
        args += ["--control-url", "http://127.0.0.1:9", "--token-file", str(token)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "operator range 203.0.113.0/24: not inside a private" in result.output
    assert not data_dir.exists()
