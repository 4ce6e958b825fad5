"""Egress over the node's HTTP API: RemoteNode ↔ create_node_app ↔ FakeNode (issue 5)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from space.node.api import (
    MAX_EGRESS_LOG_EVENTS,
    EgressLog,
    InvalidArgument,
    NotFound,
    SandboxSpec,
    Unavailable,
)
from space.node.http.client import RemoteNode
from space.node.http.server import create_node_app
from tests.unit._fake_egress import CANNED_EVENTS
from tests.unit.fakes import FakeNode
from tests.unit.test_remote_node import TOKEN, remote

pytestmark = pytest.mark.anyio

AUTH = {"Authorization": f"Bearer {TOKEN}"}
POLICY: dict[str, object] = {"allow": [{"domain": "pypi.org", "ports": [443]}]}


@pytest.fixture
async def http() -> AsyncIterator[tuple[httpx.AsyncClient, FakeNode]]:
    node = FakeNode()
    await node.create_sandbox(SandboxSpec("sb-1"))
    transport = httpx.ASGITransport(app=create_node_app(node, TOKEN))
    async with httpx.AsyncClient(transport=transport, base_url="http://node/node/v1") as client:
        yield client, node


async def test_a_specs_egress_policy_crosses_the_wire_at_create() -> None:
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1", egress=POLICY))
        await client.create_sandbox(SandboxSpec("sb-2"))
    assert node.egress == {"sb-1": POLICY, "sb-2": None}


async def test_set_egress_reaches_the_node_and_none_closes_the_network() -> None:
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        await client.set_egress("sb-1", POLICY)
        assert node.egress["sb-1"] == POLICY
        await client.set_egress("sb-1", None)
        assert node.egress["sb-1"] is None


async def test_negative_the_nodes_refusal_of_a_policy_comes_back_as_invalid_argument() -> None:
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1", egress=POLICY))
        with pytest.raises(InvalidArgument, match=r"allow\[0\]\.ports\[0\]: 0 is not a port"):
            await client.set_egress("sb-1", {"allow": [{"domain": "a.org", "ports": [0]}]})
        with pytest.raises(NotFound):
            await client.set_egress("sb-404", POLICY)
    assert node.egress["sb-1"] == POLICY


async def test_the_egress_log_round_trips_every_field() -> None:
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        node.egress_dropped["sb-1"] = 1234
        assert await client.egress_log("sb-1") == EgressLog(list(CANNED_EVENTS), 1234)
        assert await client.egress_log("sb-1", limit=1) == EgressLog([CANNED_EVENTS[-1]], 1234)


@pytest.mark.parametrize("dropped", [-1, "3", 2.0, True, None])
async def test_negative_a_node_answering_a_bad_drop_count_is_unavailable(dropped: object) -> None:
    class Miscounting(FakeNode):
        async def egress_log(self, sandbox_id: str, *, limit: int = 100) -> EgressLog:
            return EgressLog([], dropped)  # type: ignore[arg-type]

    async with remote(Miscounting()) as client:
        with pytest.raises(Unavailable, match="bad drop count"):
            await client.egress_log("sb-1")


async def test_a_node_answering_no_drop_count_has_dropped_nothing() -> None:
    async def old_answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"events": []})

    transport = httpx.MockTransport(old_answer)
    client = RemoteNode("http://node", TOKEN, transport=transport)
    try:
        assert await client.egress_log("sb-1") == EgressLog([], 0)
    finally:
        await client.aclose()


async def test_negative_a_node_answering_more_events_than_asked_is_unavailable() -> None:
    class Flooding(FakeNode):
        async def egress_log(self, sandbox_id: str, *, limit: int = 100) -> EgressLog:
            return EgressLog(list(CANNED_EVENTS) * limit)

    async with remote(Flooding()) as client:
        with pytest.raises(Unavailable, match="4 egress events, asked for 2"):
            await client.egress_log("sb-1", limit=2)


@pytest.mark.parametrize("limit", [0, MAX_EGRESS_LOG_EVENTS + 1])
async def test_negative_a_log_limit_out_of_range_is_refused_by_the_node_api(limit: int) -> None:
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        with pytest.raises(InvalidArgument):
            await client.egress_log("sb-1", limit=limit)
    assert ("egress_log", "sb-1") not in node.calls


@pytest.mark.parametrize(
    "body",
    [{}, {"policy": ["pypi.org"]}, {"policy": "pypi.org"}, {"allow": []}, ["policy"], None],
)
async def test_negative_an_egress_body_without_an_object_or_null_policy_is_refused(
    http: tuple[httpx.AsyncClient, FakeNode], body: object
) -> None:
    client, node = http
    answer = await client.put("/sandboxes/sb-1/egress", json=body, headers=AUTH)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_argument"
    assert ("set_egress", "sb-1") not in node.calls


async def test_negative_the_egress_routes_need_the_node_token(
    http: tuple[httpx.AsyncClient, FakeNode],
) -> None:
    client, node = http
    put = await client.put("/sandboxes/sb-1/egress", json={"policy": None})
    log = await client.get("/sandboxes/sb-1/egress/log")
    assert (put.status_code, log.status_code) == (401, 401)
    assert node.egress["sb-1"] is None and ("egress_log", "sb-1") not in node.calls
