"""The platform's Prometheus ``/metrics``: histograms of the replica's own creates and
execs, gauges from the database, the nodes' pool and egress counters (over FakeNodes),
the node token, a slow node; and the egress decisions the node's gateway counts."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from space.control import NodeRegistry, background
from space.control import prometheus as prometheus_route
from space.node.api import EgressEvent, NodeInfo, PoolInfo, Unavailable
from space.node.egress.audit import AuditLog
from space.node.http.client import RemoteNode
from space.node.http.server import create_node_app
from space.node.network.gateway_client import GatewayProcess
from tests.root_broker import gateway_broker
from tests.unit.fakes import FakeNode, Harness, control_app

pytestmark = pytest.mark.anyio

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _token(h: Harness) -> dict[str, str]:
    return {"Authorization": f"Bearer {h.settings.token_file.read_text().strip()}"}


async def _scrape(h: Harness) -> Samples:
    response = await h.client.get("/metrics", headers=_token(h))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


async def _sandbox(h: Harness, key: dict[str, str], **body: object) -> str:
    response = await h.client.post("/v1/sandboxes", json=body, headers=key)
    assert response.status_code == 201, response.text
    sandbox_id: str = response.json()["id"]
    return sandbox_id


async def test_sandboxes_by_state_come_from_the_database_every_state_listed(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        first, _ = await _sandbox(h, key), await _sandbox(h, key)
        await h.client.post(f"/v1/sandboxes/{first}/pause", headers=key)
        gone = await _sandbox(h, key)
        await h.client.delete(f"/v1/sandboxes/{gone}", headers=key)
        samples = await _scrape(h)
        by_state = {
            dict(labels)["state"]: value
            for (name, labels), value in samples.items()
            if name == "space_sandboxes"
        }
        assert by_state == {
            "creating": 0, "running": 1, "paused": 1, "hibernated": 0, "stopped": 0,
            "error": 0, "lost": 0,
        }  # fmt: skip
        assert samples["space_nodes", (("state", "active"),)] == 1
        assert samples["space_nodes", (("state", "lost"),)] == 0


async def test_create_and_exec_latencies_are_observed_by_source(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = await _sandbox(h, key)
        snap = await h.client.post(
            f"/v1/sandboxes/{sid}/snapshots", json={"name": "s"}, headers=key
        )
        assert snap.status_code == 201, snap.text
        await _sandbox(h, key, from_snapshot=snap.json()["id"])
        forked = await h.client.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2}, headers=key)
        assert forked.status_code == 201, forked.text
        ran = await h.client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}, headers=key)
        assert ran.status_code == 200
        samples = await _scrape(h)
        count = "space_sandbox_create_seconds_count"
        assert samples[count, (("source", "template"),)] == 1
        assert samples[count, (("source", "snapshot"),)] == 1
        assert samples[count, (("source", "fork"),)] == 2
        assert samples["space_exec_start_seconds_count", ()] == 1
        assert samples["space_exec_start_seconds_bucket", (("le", "+Inf"),)] == 1


async def test_negative_a_refused_create_is_no_latency(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        h.node.fail_create = Unavailable("no")
        response = await h.client.post("/v1/sandboxes", json={}, headers=h.key("t"))
        assert response.status_code == 503
        samples = await _scrape(h)
        assert samples["space_sandbox_create_seconds_count", (("source", "template"),)] == 0


async def test_pool_and_egress_counters_are_each_nodes_own(tmp_path: Path) -> None:
    node = FakeNode()
    node.pools = [PoolInfo("base", size=1, target=2, min_size=1, max_size=4, hits=7, misses=2)]
    node.egress_decisions = {"allow": 40, "deny": 3}
    async with control_app(tmp_path, node) as h:
        samples = await _scrape(h)
        labels = (("node", "local"), ("template", "base"))
        assert samples["space_pool_hits_total", labels] == 7
        assert samples["space_pool_misses_total", labels] == 2
        allow, deny = (("decision", "allow"), ("node", "local")), (("decision", "deny"),)
        assert samples["space_egress_decisions_total", allow] == 40
        assert samples["space_egress_decisions_total", (*deny, ("node", "local"))] == 3
        assert samples["space_scrape_node_failures", ()] == 0


class _SlowNode(FakeNode):
    async def info(self) -> NodeInfo:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_negative_a_node_slower_than_the_deadline_is_left_out_of_the_scrape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prometheus_route, "NODE_SCRAPE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(background, "INFO_TIMEOUT_S", 0.2)  # its heartbeat at the start
    fast = FakeNode("fast")
    fast.egress_decisions = {"allow": 1}
    registry = NodeRegistry()
    registry.register("fast", fast)
    registry.register("slow", _SlowNode("slow"))
    async with control_app(tmp_path, fast, registry=registry) as h:
        started = asyncio.get_running_loop().time()
        samples = await _scrape(h)
        assert asyncio.get_running_loop().time() - started < 2
        assert samples["space_scrape_node_failures", ()] == 1
        nodes = {dict(labels).get("node") for name, labels in samples if "egress" in name}
        assert nodes == {"fast"}


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer tenant-key"}]
)
async def test_negative_metrics_without_the_node_token_are_401_and_ask_no_node(
    tmp_path: Path, headers: dict[str, str]
) -> None:
    async with control_app(tmp_path) as h:
        if headers.get("Authorization") == "Bearer tenant-key":
            headers = h.key("t")  # a tenant's API key is not the operator's token
        h.node.calls.clear()
        response = await h.client.get("/metrics", headers=headers)
        assert response.status_code == 401
        assert h.node.calls == []


# -- egress decisions on the node --


def _event(decision: str) -> EgressEvent:
    return EgressEvent(1.0, "tcp", "x.org", "192.0.2.1", 443, decision, "policy")


def test_the_audit_counts_every_decision_even_those_over_its_write_budget(tmp_path: Path) -> None:
    log = AuditLog(tmp_path, rate_per_s=1, burst=1)
    for decision in ["allow", "deny", "deny", "allow", "allow"]:
        log.write("sb-1", _event(decision))
    assert log.decisions() == {"allow": 3, "deny": 2}
    assert len(log.read("sb-1")) < 5  # written or not, each was a decision


async def test_remote_node_reports_the_egress_decisions() -> None:
    node = FakeNode()
    node.egress_decisions = {"allow": 5, "deny": 1}
    transport = httpx.ASGITransport(app=create_node_app(node, "tok"))
    client = RemoteNode("http://node", "tok", transport=transport)
    try:
        assert (await client.info()).egress_decisions == {"allow": 5, "deny": 1}
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "decisions", [{"allow": -1}, {"allow": True}, {"allow": "3"}, {"maybe": 1}, [1]]
)
async def test_negative_a_node_reporting_malformed_decision_counts_is_unavailable(
    decisions: object,
) -> None:
    node = FakeNode()
    body = dataclasses.asdict(await node.info()) | {"egress_decisions": decisions}
    client = RemoteNode(
        "http://node",
        "tok",
        transport=httpx.MockTransport(lambda r: httpx.Response(200, json=body)),
    )
    try:
        with pytest.raises(Unavailable, match=r"egress.decisions"):
            await client.info()
    finally:
        await client.aclose()


def test_the_gateway_process_answers_its_decision_counts(egress_dir: Path) -> None:
    async def scenario() -> None:
        gateway = await GatewayProcess.start(
            egress_dir, ["127.0.0.1:53"], None, broker=gateway_broker(egress_dir)
        )
        try:
            assert await gateway.decisions() == {"allow": 0, "deny": 0}
        finally:
            await gateway.close()
        assert await gateway.decisions() == {}  # none answers: never started for it

    asyncio.run(scenario())
