"""Egress from a real guest through the node's gateway, into a namespace the test made.

One node and one sandbox serve the whole module (tests/egress_world.py has the map of
the little internet). Every refusal is checked twice where it can be: the guest got
no answer, and the server it aimed at saw nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from space.node.config import NodeConfig
from space.node.interface import ExecExited, ExecOutput, ExecRequest, SandboxSpec
from space.node.service import Node

from ..egress_world import HOST_SIDE, OTHER, PRIVATE, UPSTREAM, World, egress_world
from .conftest import NodeHarness, started_node

pytestmark = pytest.mark.vm

SANDBOX = "egress-1"
PROBE = Path(__file__).with_name("egress_probe.py")

POLICY: dict[str, object] = {
    "allow": [
        {"domain": "allowed.test", "ports": [80, 443, 8080]},
        {"domain": "*.allowed.test", "ports": [80, 443]},
        {"domain": "rebind.test", "ports": [80]},
        {"domain": "private.test"},
        {"domain": "loop.test"},
        {"domain": "meta.test"},
        {"domain": "host.test", "ports": [8080]},
        {"cidr": f"{UPSTREAM}/32", "ports": [8080]},
    ]
}

RECORDS: dict[str, list[str] | list[list[str]]] = {
    "allowed.test": [UPSTREAM],
    "a.allowed.test": [UPSTREAM],
    "tls.allowed.test": [UPSTREAM],
    "other.test": [OTHER],
    "rebind.test": [[UPSTREAM], [PRIVATE], ["127.0.0.1"]],
    "private.test": [PRIVATE],
    "loop.test": ["127.0.0.1"],
    "meta.test": ["169.254.169.254"],
    "host.test": [HOST_SIDE],
}


class Guest:
    """The module's sandbox, seen from inside: ``probe`` runs egress_probe.py in it."""

    def __init__(self, harness: NodeHarness, world: World) -> None:
        self.h, self.world = harness, world

    @property
    def node(self) -> Node:
        return self.h.node

    def probe(self, kind: str, **args: Any) -> dict[str, Any]:
        request = ExecRequest(
            argv=["python3", "/tmp/probe.py", json.dumps({"kind": kind, **args})],
            user="root",
            timeout_s=60,
        )
        out = self.h.run(_output(self.node, request))
        return dict(json.loads(out.strip().splitlines()[-1]))

    def audit(self) -> list[Any]:
        return self.h.run(self.node.egress_log(SANDBOX, limit=1000))


async def _output(node: Node, request: ExecRequest) -> str:
    stream = await node.exec(SANDBOX, request)
    out = b""
    async for event in stream:
        if isinstance(event, ExecOutput) and event.stream == "stdout":
            out += event.data
        elif isinstance(event, ExecExited):
            assert event.exit_code == 0, out
    return out.decode()


@pytest.fixture(scope="module")
def guest(node_config: NodeConfig) -> Iterator[Guest]:
    with egress_world() as world:
        world.records.update(RECORDS)
        config = replace(node_config, egress_resolvers=(world.resolver,))
        with started_node(config) as harness:
            spec = SandboxSpec(sandbox_id=SANDBOX, egress=POLICY)
            harness.run(harness.node.create_sandbox(spec))
            harness.run(
                harness.node.write_file(SANDBOX, "/tmp/probe.py", _chunks(PROBE.read_bytes()))
            )
            yield Guest(harness, world)


async def _chunks(data: bytes) -> Any:
    yield data


def test_an_allowed_domain_is_reached_by_name_over_http(guest: Guest) -> None:
    result = guest.probe("http", host="allowed.test")
    assert result["ok"], result
    assert "upstream host=allowed.test" in result["detail"]
    assert any(e.decision == "allow" and e.host == "allowed.test" for e in guest.audit())


def test_a_wildcard_rule_admits_one_label_and_tls_passes_with_a_matching_sni(
    guest: Guest,
) -> None:
    assert guest.probe("http", host="a.allowed.test")["ok"]
    result = guest.probe("tls", host="tls.allowed.test", sni="tls.allowed.test")
    assert result["ok"], result
    assert "tls host=tls.allowed.test" in result["detail"]


def test_a_cidr_rule_admits_its_address_and_port_directly(guest: Guest) -> None:
    result = guest.probe("http", host=UPSTREAM, port=8080)
    assert result["ok"], result
    assert "upstream:8080" in result["detail"]


def test_negative_a_domain_no_rule_names_does_not_even_resolve(guest: Guest) -> None:
    result = guest.probe("resolve", name="other.test")
    assert not result["ok"]
    assert all(name != "other.test" for name, _ in guest.world.asked)


def test_negative_a_direct_ip_no_rule_names_is_refused(guest: Guest) -> None:
    assert not guest.probe("http", host=OTHER)["ok"]
    assert not guest.probe("http", host=UPSTREAM, port=80)["ok"]
    assert not guest.world.hits_of("other")


def test_negative_an_allowed_domain_on_another_port_is_refused(guest: Guest) -> None:
    before = len(guest.world.hits_of("upstream:8080"))
    assert not guest.probe("http", host="a.allowed.test", port=8080)["ok"]
    assert len(guest.world.hits_of("upstream:8080")) == before


def test_negative_dns_rebinding_never_reaches_a_private_or_loopback_address(
    guest: Guest,
) -> None:
    results = [guest.probe("http", host="rebind.test")["ok"] for _ in range(6)]
    assert any(results), "the public answers should have passed"
    assert not all(results), "the private answers should have been refused"
    assert not guest.world.hits_of("private")
    assert not guest.world.hits_of("loopback")


@pytest.mark.parametrize("name", ["private.test", "loop.test", "meta.test", "host.test"])
def test_negative_an_allowed_name_resolving_to_a_forbidden_address_is_refused(
    guest: Guest, name: str
) -> None:
    port = 8080 if name == "host.test" else 80
    assert not guest.probe("http", host=name, port=port)["ok"]
    assert not guest.world.hits_of("private")
    assert not guest.world.hits_of("loopback")
    assert not guest.world.hits_of("host")
    denied = [e for e in guest.audit() if e.host == name and e.decision == "deny"]
    assert denied and "blocked address" in denied[-1].reason


@pytest.mark.parametrize(
    "spelling",
    [
        "169.254.169.254",
        "2852039166",
        "0xA9FEA9FE",
        "0251.0376.0251.0376",
        "169.254.43518",
        "0xa9.0xfe.0xa9.0xfe",
        "::ffff:169.254.169.254",
        "::ffff:a9fe:a9fe",
    ],
)
def test_negative_metadata_addresses_in_every_spelling_are_refused(
    guest: Guest, spelling: str
) -> None:
    result = guest.probe("http", host="metadata", address=spelling)
    assert not result["ok"], result


def test_a_live_policy_change_takes_effect_within_a_second(guest: Guest) -> None:
    narrowed: dict[str, object] = {"allow": [{"domain": "a.allowed.test"}]}
    try:
        started = time.monotonic()
        guest.h.run(guest.node.set_egress(SANDBOX, narrowed))
        took = time.monotonic() - started
        assert took < 1.0
        assert not guest.probe("http", host="allowed.test")["ok"]
        assert guest.probe("http", host="a.allowed.test")["ok"]
        guest.h.run(guest.node.set_egress(SANDBOX, None))
        assert not guest.probe("http", host="a.allowed.test")["ok"]
        assert not guest.probe("resolve", name="a.allowed.test")["ok"]
    finally:
        guest.h.run(guest.node.set_egress(SANDBOX, POLICY))
    assert guest.probe("http", host="allowed.test")["ok"]
