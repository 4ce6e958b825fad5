"""The SDK's network: ``allow``, ``create(egress=...)`` and ``sandbox.network`` (issue 5)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from space.sdk import AsyncSandbox, EgressEvent, Sandbox, allow
from space.sdk.errors import InternalError, InvalidArgument, NotFound
from tests.unit._fake_egress import CANNED_EVENTS
from tests.unit._live_api import LiveApi
from tests.unit._sdk_calls import create as _create

pytestmark = pytest.mark.anyio


def _egress_requests(api: LiveApi) -> list[tuple[str, str]]:
    return [(method, path) for method, path, _ in api.requests if "/egress" in path]


# allow()


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ("pypi.org", {"domain": "pypi.org"}),
        ("*.github.com:443", {"domain": "*.github.com", "ports": [443]}),
        ("example.com:80,8080", {"domain": "example.com", "ports": [80, 8080]}),
        ("203.0.113.0/24:5432", {"cidr": "203.0.113.0/24", "ports": [5432]}),
        ("203.0.113.0/24", {"cidr": "203.0.113.0/24"}),
        ("198.51.100.7:22", {"cidr": "198.51.100.7", "ports": [22]}),
        ("[2001:db8::/32]:443", {"cidr": "2001:db8::/32", "ports": [443]}),
        ("[2001:db8::/32]", {"cidr": "2001:db8::/32"}),
        ("pypi.org:65535", {"domain": "pypi.org", "ports": [65535]}),
        ("pypi.org:1", {"domain": "pypi.org", "ports": [1]}),
    ],
)
def test_allow_turns_a_rule_string_into_a_policy_rule(rule: str, expected: dict[str, Any]) -> None:
    assert allow(rule) == {"allow": [expected]}


def test_allow_keeps_the_rules_in_order_and_no_rules_is_no_network() -> None:
    assert allow("a.org", "b.org:22") == {
        "allow": [{"domain": "a.org"}, {"domain": "b.org", "ports": [22]}]
    }
    assert allow() == {"allow": []}


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("", "non-empty string"),
        (" pypi.org", "without spaces"),
        ("pypi.org:", "ports are numbers"),
        ("pypi.org:0", "a port is 1 to 65535"),
        ("pypi.org:65536", "a port is 1 to 65535"),
        ("pypi.org:https", "ports are numbers"),
        ("pypi.org:80,", "ports are numbers"),
        (":443", "no host before the port"),
        ("2001:db8::/32:443", "IPv6 network goes in brackets"),
        ("2001:db8::/32", "IPv6 network goes in brackets"),
        ("[2001:db8::/32:443", "unbalanced brackets"),
        ("[pypi.org]:443", "brackets are for IPv6 networks only"),
        ("[]:443", "unbalanced brackets"),
    ],
)
def test_negative_allow_refuses_a_rule_it_cannot_split(rule: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        allow(rule)


def test_negative_allow_refuses_a_rule_that_is_not_a_string() -> None:
    with pytest.raises(InvalidArgument):
        allow(443)  # type: ignore[arg-type]


# create and sandbox.network


async def test_create_sends_the_egress_policy_and_leaves_it_out_when_none(api: LiveApi) -> None:
    with_policy = await _create(api, egress=allow("pypi.org:443"))
    without = await _create(api)
    bodies = [body for method, path, body in api.bodies if path == "/v1/sandboxes"]
    assert bodies[0]["egress"] == {"allow": [{"domain": "pypi.org", "ports": [443]}]}
    assert "egress" not in bodies[1]
    assert await with_policy.network.get_policy() == {
        "allow": [{"domain": "pypi.org", "ports": [443]}]
    }
    assert await without.network.get_policy() == {"allow": []}


async def test_set_policy_answers_the_canonical_policy(api: LiveApi) -> None:
    sandbox = await _create(api)
    stored = await sandbox.network.set_policy(allow("pypi.org"))
    assert stored == {"allow": [{"domain": "pypi.org", "ports": [80, 443]}]}
    assert await sandbox.network.get_policy() == stored


async def test_negative_set_policy_raises_the_servers_message_and_keeps_the_old_one(
    api: LiveApi,
) -> None:
    sandbox = await _create(api, egress=allow("pypi.org"))
    with pytest.raises(InvalidArgument, match=r"allow\[0\]\.ports\[0\]: 0 is not a port"):
        await sandbox.network.set_policy({"allow": [{"domain": "a.org", "ports": [0]}]})
    assert (await sandbox.network.get_policy())["allow"][0]["domain"] == "pypi.org"


async def test_log_parses_every_field_of_the_events(api: LiveApi) -> None:
    sandbox = await _create(api)
    allowed, denied = await sandbox.network.log()
    assert allowed == EgressEvent(
        time=datetime.fromtimestamp(CANNED_EVENTS[0].time, UTC),
        protocol="tls",
        host="pypi.org",
        address="151.101.0.223",
        port=443,
        decision="allow",
        reason="policy",
        bytes_out=517,
        bytes_in=4096,
        secrets=("PYPI_TOKEN",),
    )
    assert allowed.allowed and not denied.allowed
    assert (denied.address, denied.port, denied.secrets) == (None, None, ())


async def test_log_carries_the_audits_drop_count(api: LiveApi) -> None:
    sandbox = await _create(api)
    assert (await sandbox.network.log()).dropped == 0
    api.node.egress_dropped[sandbox.sandbox_id] = 42
    read = await sandbox.network.log(1)
    assert read.dropped == 42 and list(read) == [read[0]] and read[-1:] == read.events[-1:]


async def test_log_sends_its_limit_which_defaults_to_100(api: LiveApi) -> None:
    sandbox = await _create(api)
    events = [replace(CANNED_EVENTS[1], host=f"h{n}.example") for n in range(1200)]
    api.node.egress_events[sandbox.sandbox_id] = events
    assert [e.host for e in await sandbox.network.log(1)] == ["h1199.example"]
    assert len(await sandbox.network.log()) == 100
    assert len(await sandbox.network.log(1000)) == 1000


@pytest.mark.parametrize("limit", [0, 1001, -5, True, 2.0])
async def test_negative_a_log_limit_out_of_range_is_refused_before_sending(
    api: LiveApi, limit: Any
) -> None:
    sandbox = await _create(api)
    with pytest.raises(InvalidArgument, match="limit must be 1 to 1000"):
        await sandbox.network.log(limit)
    assert _egress_requests(api) == []


async def test_negative_a_malformed_event_is_an_internal_error(api: LiveApi) -> None:
    # The real API cannot answer this: a tiny handler breaks its log answers.
    inner = api.transport()
    event = {"time": "2026-11-30T12:00:01+00:00", "protocol": "tls", "host": "pypi.org",
             "address": "151.101.0.223", "port": "443", "decision": "allow",
             "reason": "policy", "bytes_out": 0, "bytes_in": 0, "secrets": []}  # fmt: skip

    async def route(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/egress/log"):
            return httpx.Response(200, json={"events": [event]})
        return await inner.handle_async_request(request)

    connect = {**api.connection(), "_transport": httpx.MockTransport(route)}
    sandbox = await AsyncSandbox.create(**connect)
    with pytest.raises(InternalError, match="malformed egress event"):
        await sandbox.network.log()
    await sandbox.close()


async def test_negative_the_network_of_a_deleted_sandbox_is_not_found(api: LiveApi) -> None:
    sandbox = await _create(api)
    await (await AsyncSandbox.connect(sandbox.sandbox_id, **api.connection())).kill()
    with pytest.raises(NotFound):
        await sandbox.network.get_policy()
    with pytest.raises(NotFound):
        await sandbox.network.set_policy(allow())


def test_the_sync_sandbox_has_the_same_network(sync_api: LiveApi) -> None:
    sandbox = Sandbox.create(**sync_api.connection(), egress=allow("x.org"))
    assert sandbox.network.get_policy()["allow"][0]["domain"] == "x.org"
    assert sandbox.network.set_policy(allow()) == {"allow": []}
    assert [event.decision for event in sandbox.network.log(limit=5)] == ["allow", "deny"]
    sandbox.close()
