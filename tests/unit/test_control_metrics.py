"""Per-sandbox metrics above the node: the node's HTTP API and RemoteNode, the REST API
(``GET /v1/sandboxes/{id}/metrics``), the SDK's ``get_metrics`` and ``space metrics``."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from space.cli import CliContext, main
from space.control.reconcile import reconcile_node
from space.node.api import (
    MAX_METRICS_SAMPLES,
    NotFound,
    SandboxMetrics,
    SandboxSpec,
    SandboxState,
    Unavailable,
    encode,
)
from space.node.http.client import RemoteNode
from space.sdk import AsyncSandbox, Sandbox, SandboxMetric
from space.sdk.errors import InternalError
from space.sdk.errors import NotFound as SdkNotFound
from tests.unit._live_api import API_URL, LiveApi
from tests.unit._sdk_calls import create as _sdk_sandbox
from tests.unit.fakes import FakeNode, Harness, control_app
from tests.unit.test_remote_node import remote

pytestmark = pytest.mark.anyio

MIB = 1024 * 1024
SAMPLE = SandboxMetrics(1_800_000_000.5, 2, 12.5, 64 * MIB, 512 * MIB, 100 * MIB, 4096 * MIB)


async def _sandbox(h: Harness, key: dict[str, str]) -> str:
    response = await h.client.post("/v1/sandboxes", json={"cpus": 2}, headers=key)
    assert response.status_code == 201, response.text
    sandbox_id: str = response.json()["id"]
    return sandbox_id


# -- the node's HTTP API --


async def test_remote_node_reads_the_kept_samples_unchanged() -> None:
    node = FakeNode()
    await node.create_sandbox(_spec("sb-1"))
    node.metrics["sb-1"] = [SAMPLE]
    async with remote(node) as client:
        samples = await client.sandbox_metrics("sb-1")
    assert samples[0] == SAMPLE and len(samples) == 2  # the kept one, then a fresh one
    assert samples[1].cpu_count == 2 and samples[1].mem_total == 512 * MIB


async def test_negative_remote_node_metrics_of_an_unknown_sandbox_are_not_found() -> None:
    async with remote(FakeNode()) as client:
        with pytest.raises(NotFound):
            await client.sandbox_metrics("nope")


@pytest.mark.parametrize(
    "body",
    [
        {"samples": [encode(SAMPLE)] * (MAX_METRICS_SAMPLES + 1)},
        {"samples": [{"timestamp": 1.0}]},
        [encode(SAMPLE)],
    ],
)
async def test_negative_a_node_answering_malformed_metrics_is_unavailable(body: object) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=body)

    client = RemoteNode("http://node", "t", transport=httpx.MockTransport(answer))
    try:
        with pytest.raises(Unavailable):
            await client.sandbox_metrics("sb-1")
    finally:
        await client.aclose()


def _spec(sandbox_id: str) -> SandboxSpec:
    return SandboxSpec(sandbox_id, cpus=2, memory_mib=512, disk_mib=4096)


# -- the REST API --


async def test_metrics_of_a_running_sandbox_are_its_samples_in_snake_case(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = await _sandbox(h, key)
        h.node.metrics[sid] = [SAMPLE]
        response = await h.client.get(f"/v1/sandboxes/{sid}/metrics", headers=key)
        assert response.status_code == 200, response.text
        first, fresh = response.json()["metrics"]
        assert first == {
            "timestamp": "2027-01-15T08:00:00.500000+00:00",
            "timestamp_unix": 1_800_000_000,
            "cpu_count": 2,
            "cpu_used_pct": 12.5,
            "mem_used": 64 * MIB,
            "mem_total": 512 * MIB,
            "disk_used": 100 * MIB,
            "disk_total": 4096 * MIB,
        }
        assert fresh["cpu_count"] == 2


async def test_start_and_end_keep_the_samples_between_them_inclusive(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = await _sandbox(h, key)
        await h.client.post(f"/v1/sandboxes/{sid}/pause", headers=key)
        h.node.metrics[sid] = [replace(SAMPLE, timestamp=float(t)) for t in (100, 200, 300)]
        url = f"/v1/sandboxes/{sid}/metrics"
        answer = await h.client.get(url, params={"start": 200, "end": 300}, headers=key)
        assert [m["timestamp_unix"] for m in answer.json()["metrics"]] == [200, 300]
        answer = await h.client.get(url, params={"end": 199}, headers=key)
        assert [m["timestamp_unix"] for m in answer.json()["metrics"]] == [100]


@pytest.mark.parametrize("action", ["pause", "hibernate"])
async def test_metrics_of_a_sleeping_sandbox_are_the_kept_ones_and_do_not_wake_it(
    tmp_path: Path, action: str
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = await _sandbox(h, key)
        await h.client.post(f"/v1/sandboxes/{sid}/{action}", headers=key)
        h.node.metrics[sid] = [SAMPLE]
        before = (await h.client.get(f"/v1/sandboxes/{sid}", headers=key)).json()
        response = await h.client.get(f"/v1/sandboxes/{sid}/metrics", headers=key)
        assert [m["timestamp_unix"] for m in response.json()["metrics"]] == [1_800_000_000]
        after = (await h.client.get(f"/v1/sandboxes/{sid}", headers=key)).json()
        assert after == before and after["state"] == h.node.boxes[sid].status.state.value
        assert h.node.boxes[sid].status.state != SandboxState.RUNNING


async def test_metrics_of_a_sandbox_in_error_are_empty_and_ask_no_node(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = await _sandbox(h, key)
        box = h.node.boxes[sid]
        box.status = replace(box.status, state=SandboxState.ERROR, error="VM exited")
        await reconcile_node(h.app.state.ctx, "local")
        h.node.calls.clear()
        response = await h.client.get(f"/v1/sandboxes/{sid}/metrics", headers=key)
        assert (response.status_code, response.json()) == (200, {"metrics": []})
        assert h.node.calls == []


@pytest.mark.parametrize("query", ["start=-1", "end=x", "start=7289654401"])
async def test_negative_a_malformed_time_bound_is_422_and_asks_no_node(
    tmp_path: Path, query: str
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = await _sandbox(h, key)
        h.node.calls.clear()
        response = await h.client.get(f"/v1/sandboxes/{sid}/metrics?{query}", headers=key)
        assert response.status_code == 422 and h.node.calls == []


async def test_negative_another_tenants_sandbox_metrics_are_404(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        sid = await _sandbox(h, h.key("t"))
        h.node.calls.clear()
        response = await h.client.get(f"/v1/sandboxes/{sid}/metrics", headers=h.key("other"))
        assert response.status_code == 404 and h.node.calls == []
        response = await h.client.get(f"/v1/sandboxes/{sid}/metrics")
        assert response.status_code == 401


# -- the SDK and the CLI --


async def test_sdk_get_metrics_parses_the_samples_and_sends_the_bounds(api: LiveApi) -> None:
    sandbox = await _sdk_sandbox(api, cpus=2)
    api.node.metrics[sandbox.sandbox_id] = [SAMPLE]
    assert len(await sandbox.get_metrics()) == 2  # the kept sample and a fresh one (now)
    # The kept sample is in 2027: bounds around its second leave the fresh one out.
    since = datetime.fromtimestamp(1_800_000_000, UTC)
    samples = await sandbox.get_metrics(start=since, end=1_800_000_000)
    assert samples == [
        SandboxMetric(
            datetime.fromtimestamp(1_800_000_000.5, UTC), 2, 12.5, 64 * MIB, 512 * MIB,
            100 * MIB, 4096 * MIB,
        )
    ]  # fmt: skip


async def test_negative_sdk_get_metrics_of_a_deleted_sandbox_is_not_found(api: LiveApi) -> None:
    sandbox = await _sdk_sandbox(api)
    other = await AsyncSandbox.connect(sandbox.sandbox_id, **api.connection())
    await sandbox.kill()
    with pytest.raises(SdkNotFound):
        await other.get_metrics()
    await other.close()


@pytest.mark.parametrize(
    "field, value", [("cpu_used_pct", 101), ("mem_used", -1), ("timestamp", "yesterday")]
)
def test_negative_a_malformed_metric_is_an_internal_error(field: str, value: object) -> None:
    wire = {
        "timestamp": "2027-01-15T08:00:00+00:00",
        "timestamp_unix": 1,
        "cpu_count": 1,
        "cpu_used_pct": 1.0,
        "mem_used": 1,
        "mem_total": 2,
        "disk_used": 1,
        "disk_total": 2,
    }
    with pytest.raises(InternalError):
        SandboxMetric.from_wire(wire | {field: value})


def test_space_metrics_prints_one_row_per_sample(sync_api: LiveApi) -> None:
    sandbox = Sandbox.create(**sync_api.connection(), cpus=2)
    sync_api.node.metrics[sandbox.sandbox_id] = [SAMPLE]
    result = CliRunner().invoke(
        main,
        ["metrics", sandbox.sandbox_id],
        obj=CliContext(transport=sync_api.transport()),
        env={"SPACE_API_KEY": sync_api.key, "SPACE_API_URL": API_URL},
    )
    assert result.exit_code == 0, result.output
    header, kept, fresh = result.output.splitlines()
    assert header.split() == [
        "TIME", "CPUS", "CPU_PCT", "MEM_USED_MIB", "MEM_TOTAL_MIB", "DISK_USED_MIB",
        "DISK_TOTAL_MIB",
    ]  # fmt: skip
    assert kept.split()[2:] == ["2", "12.5", "64", "512", "100", "4096"]
    assert fresh.split()[2] == "2"
