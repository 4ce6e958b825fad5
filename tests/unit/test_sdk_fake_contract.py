"""The fake API (tests/unit/test_sdk_fake_api.py) itself follows the contract.

The SDK and CLI tests run against the fake; these pin the fake to docs/api.md and to the
lifecycle contract of issue 3, so those tests do not test the SDK against a wrong fake.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import pytest

from tests.unit.test_sdk_fake_api import API_KEY, SIZES, FakeApi

pytestmark = pytest.mark.anyio


async def _client(fake: FakeApi) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=fake.transport(),
        base_url="http://space",
        headers={"Authorization": f"Bearer {API_KEY}"},
    )


async def test_fake_api_creates_sandbox_with_201_and_the_documented_fields(fake: FakeApi) -> None:
    async with await _client(fake) as client:
        answer = await client.post("/v1/sandboxes", json={"template": "base"})
    assert answer.status_code == 201
    assert set(answer.json()) == {
        "id", "template", "state", "cpus", "memory_mib", "disk_mib",
        "env", "metadata", "created_at", "expires_at", "node_id",
        "idle_timeout_s", "max_lifetime_s", "last_active_at", "head_snapshot", "egress",
    }  # fmt: skip


async def test_negative_fake_api_answers_401_in_the_error_shape_without_a_key(
    fake: FakeApi,
) -> None:
    async with httpx.AsyncClient(transport=fake.transport(), base_url="http://x") as client:
        answer = await client.get("/v1/sandboxes")
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "unauthenticated"


async def test_fake_api_exec_streams_start_output_exit_as_ndjson(fake: FakeApi) -> None:
    fake.sandboxes["s1"] = {"id": "s1"}
    fake.scripts["echo hi"] = [("stdout", b"hi\n"), ("exit", 0, None, False)]
    async with await _client(fake) as client:
        answer = await client.post("/v1/sandboxes/s1/exec", json={"cmd": "echo hi"})
    events = [json.loads(line) for line in answer.text.splitlines()]
    assert answer.headers["content-type"] == "application/x-ndjson"
    assert [e["type"] for e in events] == ["start", "stdout", "exit"]
    assert base64.b64decode(events[1]["data"]) == b"hi\n"


async def test_fake_api_pause_and_resume_answer_the_sandbox_in_its_new_state(
    fake: FakeApi,
) -> None:
    async with await _client(fake) as client:
        sid = (await client.post("/v1/sandboxes", json={})).json()["id"]
        paused = await client.post(f"/v1/sandboxes/{sid}/pause")
        again = await client.post(f"/v1/sandboxes/{sid}/pause")
        resumed = await client.post(f"/v1/sandboxes/{sid}/resume")
    assert (paused.status_code, paused.json()["state"]) == (200, "paused")
    assert (again.status_code, again.json()["state"]) == (200, "paused")
    assert (resumed.status_code, resumed.json()["state"]) == (200, "running")


async def test_negative_fake_api_pause_of_a_sandbox_in_error_is_409_naming_the_state(
    fake: FakeApi,
) -> None:
    fake.sandboxes["s1"] = {"id": "s1", "state": "error"}
    async with await _client(fake) as client:
        answer = await client.post("/v1/sandboxes/s1/pause")
    assert answer.status_code == 409
    assert answer.json()["error"]["details"] == {"state": "error"}
    assert fake.sandboxes["s1"]["state"] == "error"


async def test_fake_api_hibernate_then_resume_wakes_the_sandbox(fake: FakeApi) -> None:
    async with await _client(fake) as client:
        sid = (await client.post("/v1/sandboxes", json={})).json()["id"]
        hibernated = await client.post(f"/v1/sandboxes/{sid}/hibernate")
        resumed = await client.post(f"/v1/sandboxes/{sid}/resume")
    assert (hibernated.status_code, hibernated.json()["state"]) == (200, "hibernated")
    assert (resumed.status_code, resumed.json()["state"]) == (200, "running")


async def test_fake_api_snapshot_tree_follows_the_head_and_is_reparented_on_delete(
    fake: FakeApi,
) -> None:
    async with await _client(fake) as client:
        sid = (await client.post("/v1/sandboxes", json={})).json()["id"]
        first = (await client.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "a"})).json()
        second = await client.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "b"})
        deleted = await client.delete(f"/v1/snapshots/{first['id']}")
        again = await client.delete(f"/v1/snapshots/{first['id']}")
        listed = (await client.get("/v1/snapshots")).json()["snapshots"]
    assert second.status_code == 201 and second.json()["parent_id"] == first["id"]
    assert (deleted.status_code, again.status_code) == (204, 204)
    assert [(s["name"], s["parent_id"]) for s in listed] == [("b", None)]


async def test_negative_fake_api_snapshot_name_taken_is_409_naming_the_snapshot(
    fake: FakeApi,
) -> None:
    async with await _client(fake) as client:
        sid = (await client.post("/v1/sandboxes", json={})).json()["id"]
        first = (await client.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "a"})).json()
        taken = await client.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "a"})
    assert taken.status_code == 409
    assert taken.json()["error"]["details"] == {"snapshot_id": first["id"]}
    assert len(fake.snapshots) == 1


@pytest.mark.parametrize("size", SIZES)
async def test_negative_fake_api_create_from_snapshot_with_a_size_is_422(
    fake: FakeApi, size: str
) -> None:
    value: Any = "base" if size == "template" else 1
    async with await _client(fake) as client:
        answer = await client.post("/v1/sandboxes", json={"from_snapshot": "x", size: value})
    assert answer.status_code == 422 and fake.sandboxes == {}


@pytest.mark.parametrize("count", [0, 17, "2"])
async def test_negative_fake_api_fork_count_out_of_range_is_422(fake: FakeApi, count: Any) -> None:
    async with await _client(fake) as client:
        sid = (await client.post("/v1/sandboxes", json={})).json()["id"]
        answer = await client.post(f"/v1/sandboxes/{sid}/fork", json={"count": count})
    assert answer.status_code == 422 and list(fake.sandboxes) == [sid]


async def test_fake_api_timeouts_change_only_the_fields_sent(fake: FakeApi) -> None:
    async with await _client(fake) as client:
        sid = (await client.post("/v1/sandboxes", json={"idle_timeout_s": 60})).json()["id"]
        answer = await client.put(f"/v1/sandboxes/{sid}/timeouts", json={"max_lifetime_s": None})
    assert (answer.json()["idle_timeout_s"], answer.json()["max_lifetime_s"]) == (60, None)
