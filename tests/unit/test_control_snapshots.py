"""Snapshots, restore, fork and create-from-snapshot through the REST API, over FakeNodes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from space.control import NodeRegistry
from space.control.store import snapshots as snaps
from space.control.store.snapshots import SnapshotRecord
from space.node.api import SandboxState, Unavailable
from tests.unit.fakes import FakeNode, Harness, control_app

# DB-level: each test runs on SQLite and on PostgreSQL (issue 19).
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("on_both_databases")]

_SNAPSHOT_FIELDS = {
    "id",
    "name",
    "sandbox_id",
    "parent_id",
    "node_id",
    "created_at",
    "template",
    "cpus",
    "memory_mib",
    "disk_mib",
    "memory_bytes",
    "exclusive_bytes",
    "archived",
}


async def _create(h: Harness, key: dict[str, str], **body: Any) -> dict[str, Any]:
    response = await h.client.post("/v1/sandboxes", json=body, headers=key)
    assert response.status_code == 201, response.text
    sandbox: dict[str, Any] = response.json()
    return sandbox


async def _snap(h: Harness, sid: str, key: dict[str, str], name: str) -> dict[str, Any]:
    response = await h.client.post(
        f"/v1/sandboxes/{sid}/snapshots", json={"name": name}, headers=key
    )
    assert response.status_code == 201, response.text
    snapshot: dict[str, Any] = response.json()
    return snapshot


async def _get(h: Harness, url: str, key: dict[str, str]) -> Any:
    response = await h.client.get(url, headers=key)
    assert response.status_code == 200, response.text
    return response.json()


async def _write(h: Harness, sid: str, key: dict[str, str], data: bytes) -> None:
    url = f"/v1/sandboxes/{sid}/files"
    response = await h.client.put(url, params={"path": "/f"}, content=data, headers=key)
    assert response.status_code == 200, response.text


async def test_a_snapshot_is_made_listed_and_becomes_the_sandboxs_head(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sandbox = await _create(h, key, cpus=2, memory_mib=512)
        snapshot = await _snap(h, sandbox["id"], key, "first")
        assert set(snapshot) == _SNAPSHOT_FIELDS
        assert re.fullmatch(r"sn-[0-9a-f]{24}", snapshot["id"])
        assert snapshot["sandbox_id"] == sandbox["id"] and snapshot["parent_id"] is None
        assert (snapshot["name"], snapshot["node_id"], snapshot["cpus"]) == ("first", "local", 2)
        assert snapshot["memory_bytes"] == h.node.snapshots[snapshot["id"]].info.memory_bytes
        assert snapshot["exclusive_bytes"] is None
        after = await _get(h, f"/v1/sandboxes/{sandbox['id']}", key)
        assert (after["head_snapshot"], after["state"]) == (snapshot["id"], "running")
        listed = await _get(h, f"/v1/sandboxes/{sandbox['id']}/snapshots", key)
        assert listed == {"snapshots": [snapshot]}
        one = await _get(h, f"/v1/snapshots/{snapshot['id']}", key)
        assert one == {**snapshot, "exclusive_bytes": 4096}


@pytest.mark.parametrize("action", ["pause", "hibernate"])
async def test_a_snapshot_of_a_suspended_sandbox_keeps_its_state(
    tmp_path: Path, action: str
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        state = (await h.client.post(f"/v1/sandboxes/{sid}/{action}", headers=key)).json()["state"]
        await _snap(h, sid, key, "s")
        assert (await _get(h, f"/v1/sandboxes/{sid}", key))["state"] == state
        assert h.node.boxes[sid].status.state.value == state


async def test_snapshots_form_a_forest_listed_oldest_first(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        one, two = (await _create(h, key))["id"], (await _create(h, key))["id"]
        a = await _snap(h, one, key, "a")
        h.clock.now += 1
        b = await _snap(h, one, key, "b")
        h.clock.now += 1
        c = await _snap(h, two, key, "a")  # names are per sandbox
        assert (b["parent_id"], c["parent_id"]) == (a["id"], None)
        everything = (await _get(h, "/v1/snapshots", key))["snapshots"]
        assert [s["id"] for s in everything] == [a["id"], b["id"], c["id"]]
        of_one = (await _get(h, f"/v1/sandboxes/{one}/snapshots", key))["snapshots"]
        assert [s["id"] for s in of_one] == [a["id"], b["id"]]


async def test_deleting_a_snapshot_reparents_its_children_and_heads_and_is_idempotent(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        a = await _snap(h, sid, key, "a")
        b = await _snap(h, sid, key, "b")
        c = await _snap(h, sid, key, "c")
        for victim in (b, c):
            for _ in range(2):
                gone = await h.client.delete(f"/v1/snapshots/{victim['id']}", headers=key)
                assert gone.status_code == 204
        assert victim["id"] not in h.node.snapshots
        listed = (await _get(h, "/v1/snapshots", key))["snapshots"]
        assert [(s["id"], s["parent_id"]) for s in listed] == [(a["id"], None)]
        assert (await _get(h, f"/v1/sandboxes/{sid}", key))["head_snapshot"] == a["id"]
        assert h.node.boxes[sid].status.head_snapshot == a["id"]
        d = await _snap(h, sid, key, "b")  # a deleted snapshot's name is free again
        assert d["parent_id"] == a["id"]
        missing = await h.client.get(f"/v1/snapshots/{b['id']}", headers=key)
        assert missing.status_code == 404


async def test_negative_a_snapshot_name_already_taken_is_409_with_the_existing_id(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        first = await _snap(h, sid, key, "same")
        node_before = h.node.snapshot()
        again = await h.client.post(
            f"/v1/sandboxes/{sid}/snapshots", json={"name": "same"}, headers=key
        )
        error = again.json()["error"]
        assert again.status_code == 409 and error["code"] == "conflict"
        assert error["details"]["snapshot_id"] == first["id"]
        assert h.node.snapshot() == node_before
        assert len((await _get(h, "/v1/snapshots", key))["snapshots"]) == 1


async def test_negative_a_node_failing_mid_snapshot_lists_nothing_and_frees_the_name(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        h.node.fail_next = Unavailable("disk full")
        failed = await h.client.post(
            f"/v1/sandboxes/{sid}/snapshots", json={"name": "s"}, headers=key
        )
        assert failed.status_code == 503
        assert (await _get(h, "/v1/snapshots", key))["snapshots"] == []
        assert (await _get(h, f"/v1/sandboxes/{sid}", key))["head_snapshot"] is None
        await _snap(h, sid, key, "s")


@pytest.mark.parametrize("name", ["", "-a", ".a", "a" * 64, "a b", "ä", None, 5])
async def test_negative_bad_snapshot_names_are_422(tmp_path: Path, name: object) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        answer = await h.client.post(
            f"/v1/sandboxes/{sid}/snapshots", json={"name": name}, headers=key
        )
        assert answer.status_code == 422 and "name" in answer.json()["error"]["message"]
        assert h.node.snapshots == {}


async def test_a_snapshot_name_of_63_characters_is_accepted(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        assert (await _snap(h, sid, key, "A" + "b_.-9" * 12 + "xx"))["name"].startswith("Ab")


async def test_negative_deleting_an_unknown_snapshot_is_404(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        answer = await h.client.delete("/v1/snapshots/sn-" + "0" * 24, headers=h.key("t"))
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"


async def test_a_snapshot_delete_the_node_failed_is_hidden_and_finished_by_a_retry(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        snapshot = await _snap(h, sid, key, "s")
        url = f"/v1/snapshots/{snapshot['id']}"
        h.node.delete_snapshot = _failing(h.node.delete_snapshot)  # type: ignore[method-assign]
        assert (await h.client.delete(url, headers=key)).status_code == 503
        assert (await _get(h, "/v1/snapshots", key))["snapshots"] == []
        assert snapshot["id"] in h.node.snapshots
        assert (await h.client.delete(url, headers=key)).status_code == 204
        assert snapshot["id"] not in h.node.snapshots


def _failing(method: Any) -> Any:
    """``method``, raising Unavailable on its first call."""
    failures = [Unavailable("node down")]

    async def call(*args: Any) -> Any:
        if failures:
            raise failures.pop()
        return await method(*args)

    return call


async def test_restore_rolls_the_sandbox_back_and_leaves_it_running(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        await _write(h, sid, key, b"before")
        snapshot = await _snap(h, sid, key, "s")
        await _write(h, sid, key, b"after")
        await h.client.post(f"/v1/sandboxes/{sid}/hibernate", headers=key)
        body = {"snapshot_id": snapshot["id"]}
        answer = await h.client.post(f"/v1/sandboxes/{sid}/restore", json=body, headers=key)
        assert answer.status_code == 200, answer.text
        restored = answer.json()
        assert (restored["state"], restored["head_snapshot"]) == ("running", snapshot["id"])
        assert restored["last_active_at"] is not None
        assert h.node.boxes[sid].files["/f"] == b"before"
        assert (await _get(h, f"/v1/sandboxes/{sid}", key))["state"] == "running"


async def test_negative_restore_to_a_snapshot_on_another_node_is_409(tmp_path: Path) -> None:
    first, second = FakeNode("n1"), FakeNode("n2")
    registry = NodeRegistry()
    registry.register("n1", first)
    registry.register("n2", second)
    async with control_app(tmp_path, first, registry=registry) as h:
        key = h.key("t")
        one, two = (await _create(h, key))["id"], (await _create(h, key))["id"]
        snapshot = await _snap(h, one, key, "s")
        body = {"snapshot_id": snapshot["id"]}
        answer = await h.client.post(f"/v1/sandboxes/{two}/restore", json=body, headers=key)
        assert answer.status_code == 409
        assert "on node n1" in answer.json()["error"]["message"]
        assert [c for c in second.calls if c[0] == "restore_sandbox"] == []


async def test_negative_restore_to_a_snapshot_of_another_shape_is_422(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        big, small = (await _create(h, key, cpus=2))["id"], (await _create(h, key))["id"]
        snapshot = await _snap(h, big, key, "s")
        body = {"snapshot_id": snapshot["id"]}
        answer = await h.client.post(f"/v1/sandboxes/{small}/restore", json=body, headers=key)
        assert answer.status_code == 422 and "cpus" in answer.json()["error"]["message"]
        assert h.node.boxes[small].status.head_snapshot is None


async def test_negative_restore_to_an_unknown_or_deleted_snapshot_is_404(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        snapshot = await _snap(h, sid, key, "s")
        await h.client.delete(f"/v1/snapshots/{snapshot['id']}", headers=key)
        for snapshot_id in (snapshot["id"], "sn-" + "0" * 24):
            body = {"snapshot_id": snapshot_id}
            answer = await h.client.post(f"/v1/sandboxes/{sid}/restore", json=body, headers=key)
            assert answer.status_code == 404


async def test_fork_makes_running_copies_with_the_parents_settings(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        parent = await _create(
            h, key, cpus=2, env={"A": "1"}, metadata={"m": "x"}, idle_timeout_s=60, timeout_s=600
        )
        await _write(h, parent["id"], key, b"data")
        await h.client.post(f"/v1/sandboxes/{parent['id']}/pause", headers=key)
        h.clock.now += 100
        answer = await h.client.post(
            f"/v1/sandboxes/{parent['id']}/fork", json={"count": 2}, headers=key
        )
        assert answer.status_code == 201, answer.text
        children = answer.json()["sandboxes"]
        assert len({c["id"] for c in children} - {parent["id"]}) == 2
        same = ("template", "cpus", "memory_mib", "disk_mib", "env", "metadata", "node_id")
        for child in children:
            assert re.fullmatch(r"sb-[0-9a-f]{24}", child["id"])
            assert child["state"] == "running"
            assert {k: child[k] for k in same} == {k: parent[k] for k in same}
            assert (child["idle_timeout_s"], child["max_lifetime_s"]) == (60, 600)
            assert h.node.boxes[child["id"]].files["/f"] == b"data"
        assert (await _get(h, f"/v1/sandboxes/{parent['id']}", key))["state"] == "paused"
        listed = (await _get(h, "/v1/sandboxes", key))["sandboxes"]
        assert len(listed) == 3
        assert h.node.calls.count(("fork_sandbox", parent["id"])) == 1


async def test_fork_without_a_body_makes_one_copy_and_sixteen_is_allowed(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        one = await h.client.post(f"/v1/sandboxes/{sid}/fork", headers=key)
        assert one.status_code == 201 and len(one.json()["sandboxes"]) == 1
        many = await h.client.post(f"/v1/sandboxes/{sid}/fork", json={"count": 16}, headers=key)
        assert many.status_code == 201 and len(many.json()["sandboxes"]) == 16


@pytest.mark.parametrize("count", [0, 17, "2", None])
async def test_negative_a_fork_count_out_of_range_is_422(tmp_path: Path, count: object) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        answer = await h.client.post(
            f"/v1/sandboxes/{sid}/fork", json={"count": count}, headers=key
        )
        assert answer.status_code == 422 and "count" in answer.json()["error"]["message"]
        assert list(h.node.boxes) == [sid]


async def test_negative_a_node_failing_a_fork_leaves_no_children(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        h.node.fail_next = Unavailable("out of memory")
        answer = await h.client.post(f"/v1/sandboxes/{sid}/fork", json={"count": 3}, headers=key)
        assert answer.status_code == 503
        assert [s["id"] for s in (await _get(h, "/v1/sandboxes", key))["sandboxes"]] == [sid]
        assert list(h.node.boxes) == [sid]


async def test_a_sandbox_from_a_snapshot_is_placed_on_its_node_with_its_shape(
    tmp_path: Path,
) -> None:
    first, second = FakeNode("n1"), FakeNode("n2")
    registry = NodeRegistry()
    registry.register("n1", first)
    registry.register("n2", second)
    async with control_app(tmp_path, first, registry=registry) as h:
        key = h.key("t")
        source = await _create(h, key, cpus=3, memory_mib=1024, disk_mib=4096)
        await _write(h, source["id"], key, b"saved")
        snapshot = await _snap(h, source["id"], key, "s")
        copies = [
            await _create(h, key, from_snapshot=snapshot["id"], env={"B": "2"}, idle_timeout_s=9)
            for _ in range(2)
        ]
        for copy in copies:
            assert copy["node_id"] == "n1"  # though n2 has fewer sandboxes
            assert (copy["cpus"], copy["memory_mib"], copy["disk_mib"]) == (3, 1024, 4096)
            assert (copy["head_snapshot"], copy["idle_timeout_s"]) == (snapshot["id"], 9)
            assert first.boxes[copy["id"]].files["/f"] == b"saved"
        assert second.boxes == {}


@pytest.mark.parametrize("field", ["template", "cpus", "memory_mib", "disk_mib"])
async def test_negative_resources_given_with_from_snapshot_are_422(
    tmp_path: Path, field: str
) -> None:
    values = {"template": "base", "cpus": 1, "memory_mib": 256, "disk_mib": 2048}
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        snapshot = await _snap(h, sid, key, "s")
        body = {"from_snapshot": snapshot["id"], field: values[field]}
        answer = await h.client.post("/v1/sandboxes", json=body, headers=key)
        assert answer.status_code == 422
        assert field in answer.json()["error"]["message"]
        assert list(h.node.boxes) == [sid]


async def test_negative_a_sandbox_from_an_unknown_snapshot_is_404_and_leaves_no_row(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        body = {"from_snapshot": "sn-" + "0" * 24}
        answer = await h.client.post("/v1/sandboxes", json=body, headers=key)
        assert answer.status_code == 404
        assert (await _get(h, "/v1/sandboxes", key))["sandboxes"] == []


def _pending(sandbox_id: str, snapshot_id: str) -> SnapshotRecord:
    return SnapshotRecord(
        id=snapshot_id,
        tenant_id="t",
        sandbox_id=sandbox_id,
        node_id="local",
        name=snapshot_id,
        parent_id=None,
        state=snaps.PENDING,
        created_at=1.0,
        template="base",
        cpus=1,
        memory_mib=256,
        disk_mib=2048,
        memory_bytes=0,
    )


async def test_reconciliation_settles_snapshots_a_crash_left_half_made(tmp_path: Path) -> None:
    node = FakeNode()
    async with control_app(tmp_path, node) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        db = h.app.state.ctx.db
        # A crash after the pending row, before (lost) or after (finished) the node's work.
        for snapshot_id in ("sn-lost", "sn-finished"):
            await db.run(lambda s, i=snapshot_id: snaps.insert_snapshot(s, _pending(sid, i)))
        await node.snapshot_sandbox(sid, "sn-finished")
        await node.snapshot_sandbox(sid, "sn-stray")  # no row claims it
        assert (await _get(h, "/v1/snapshots", key))["snapshots"] == []
    async with control_app(tmp_path, node) as h:
        listed = (await _get(h, "/v1/snapshots", key))["snapshots"]
        assert [s["id"] for s in listed] == ["sn-finished"]
        assert set(node.snapshots) == {"sn-finished"}
        rows = await h.app.state.ctx.db.run(lambda s: snaps.on_node(s, "local"))
        assert [row.id for row in rows] == ["sn-finished"]
        assert node.boxes[sid].status.state is SandboxState.RUNNING
