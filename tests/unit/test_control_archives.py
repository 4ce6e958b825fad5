"""Issue 19 on the control plane: snapshots and hibernated sandboxes kept in the
artifact store, restored on another node, and their stale bundles deleted; over fake
nodes sharing an in-memory store (the real nodes' side: tests/integration/test_archives.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from space.control.background import background_round
from space.control.reconcile import reconcile
from space.node.api import snapshot_archive
from tests.unit._fake_archives import FakeArchiveStore
from tests.unit.fakes import FakeClock, FakeNode, Harness
from tests.unit.test_control_nodes import _ctx, _heartbeat, _replica, _token

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("on_both_databases")]


@contextlib.asynccontextmanager
async def _cluster(
    tmp_path: Path, *names: str, store: FakeArchiveStore | None = None
) -> AsyncIterator[tuple[Harness, dict[str, FakeNode], FakeClock]]:
    """A replica and fake nodes ``names`` sharing ``store`` (a fresh one if None),
    each registered as having it."""
    shared = store or FakeArchiveStore()
    clock, fakes = FakeClock(), {n: FakeNode(n, shared) for n in names}
    async with _replica(tmp_path, fakes, clock) as h:
        for name in names:
            await _heartbeat(h, name, archives=True)
        yield h, fakes, clock


async def _create(h: Harness, headers: dict[str, str], **body: Any) -> dict[str, Any]:
    answer = await h.client.post("/v1/sandboxes", json=body, headers=headers)
    assert answer.status_code == 201, answer.text
    created: dict[str, Any] = answer.json()
    return created


async def _get(h: Harness, path: str, headers: dict[str, str]) -> dict[str, Any]:
    answer = await h.client.get(path, headers=headers)
    assert answer.status_code == 200, answer.text
    got: dict[str, Any] = answer.json()
    return got


async def _lose(h: Harness, clock: FakeClock, lost: str, *alive: str) -> None:
    """Let ``lost``'s lease run out while ``alive`` heartbeat, and run a round."""
    clock.now += h.settings.node_lease_s + 1
    for name in alive:
        await _heartbeat(h, name, archives=True)
    await background_round(_ctx(h))


async def test_a_hibernated_sandbox_is_archived_and_its_bundle_goes_when_it_wakes(
    tmp_path: Path,
) -> None:
    store = FakeArchiveStore()
    async with _cluster(tmp_path, "n1", store=store) as (h, fakes, _clock):
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        await background_round(_ctx(h))
        assert not (await _get(h, f"/v1/sandboxes/{sid}", headers))["archived"]  # running

        await h.client.post(f"/v1/sandboxes/{sid}/hibernate", headers=headers)
        await background_round(_ctx(h))
        assert (await _get(h, f"/v1/sandboxes/{sid}", headers))["archived"]
        (bundle,) = store.objects
        assert bundle.startswith(f"sandboxes/{sid}/")
        await background_round(_ctx(h))  # uploaded once, not every round
        assert [c for c in fakes["n1"].calls if c[0] == "archive_sandbox"] == [
            ("archive_sandbox", sid)
        ]

        woke = await h.client.post(f"/v1/sandboxes/{sid}/resume", headers=headers)
        assert woke.json()["state"] == "running" and not woke.json()["archived"]
        await background_round(_ctx(h))
        assert store.objects == {}


async def test_a_lost_nodes_archived_sandbox_wakes_on_another_node_with_its_files(
    tmp_path: Path,
) -> None:
    store = FakeArchiveStore()
    async with _cluster(tmp_path, "n1", "n2", store=store) as (h, fakes, clock):
        headers = h.key("acme")
        await _heartbeat(h, "n2", archives=True, room=0)  # everything lands on n1 first
        policy = {"allow": [{"domain": "pypi.org"}]}
        kept = (await _create(h, headers, egress=policy))["id"]
        unarchived = (await _create(h, headers))["id"]
        home, other = "n1", "n2"
        assert {kept, unarchived} <= fakes[home].boxes.keys()
        fakes[home].boxes[kept].files["/home/user/work.txt"] = b"mine"
        await h.client.post(f"/v1/sandboxes/{kept}/hibernate", headers=headers)
        await background_round(_ctx(h))
        assert (await _get(h, f"/v1/sandboxes/{kept}", headers))["archived"]

        await _lose(h, clock, home, other)

        row = await _get(h, f"/v1/sandboxes/{kept}", headers)
        assert row["node_id"] == other and row["state"] == "hibernated" and row["archived"]
        assert fakes[other].boxes[kept].files["/home/user/work.txt"] == b"mine"
        # The row's policy follows it (as the control plane keeps it: canonical).
        assert (
            fakes[other].egress[kept] == (await _get(h, f"/v1/sandboxes/{kept}", headers))["egress"]
        )
        assert "pypi.org" in str(fakes[other].egress[kept])
        woke = await h.client.post(f"/v1/sandboxes/{kept}/resume", headers=headers)
        assert woke.json()["state"] == "running" and woke.json()["node_id"] == other

        # Never archived (running when its node was lost): lost, where it was.
        left = await _get(h, f"/v1/sandboxes/{unarchived}", headers)
        assert left["state"] == "lost" and left["node_id"] == home
        # The old node comes back: its copy of the moved one is nobody's, and is deleted;
        # the other is its own again.
        await _heartbeat(h, home, archives=True)
        assert kept not in fakes[home].boxes and kept in fakes[other].boxes
        back = await _get(h, f"/v1/sandboxes/{unarchived}", headers)
        assert back["state"] == "running" and back["node_id"] == home


async def test_negative_a_lost_sandbox_no_bundle_holds_stays_lost(tmp_path: Path) -> None:
    store = FakeArchiveStore()
    async with _cluster(tmp_path, "n1", "n2", store=store) as (h, fakes, clock):
        headers = h.key("acme")
        await _heartbeat(h, "n2", archives=True, room=0)
        sid = (await _create(h, headers))["id"]
        await h.client.post(f"/v1/sandboxes/{sid}/pause", headers=headers)  # not hibernated
        await background_round(_ctx(h))
        await _lose(h, clock, "n1", "n2")
        row = await _get(h, f"/v1/sandboxes/{sid}", headers)
        assert row["state"] == "lost" and row["node_id"] == "n1" and not row["archived"]
        assert sid not in fakes["n2"].boxes


async def test_negative_a_sandbox_whose_row_changed_during_its_restore_is_not_taken(
    tmp_path: Path,
) -> None:
    store = FakeArchiveStore()
    async with _cluster(tmp_path, "n1", "n2", store=store) as (h, fakes, clock):
        headers = h.key("acme")
        await _heartbeat(h, "n2", archives=True, room=0)  # everything lands on n1
        sid = (await _create(h, headers))["id"]
        await h.client.post(f"/v1/sandboxes/{sid}/hibernate", headers=headers)
        await background_round(_ctx(h))
        clock.now += h.settings.node_lease_s + 1
        await _heartbeat(h, "n2", archives=True)
        ctx = _ctx(h)
        real_import = fakes["n2"].import_archive

        async def deleted_meanwhile(sandbox_id: str, archive: str) -> Any:
            result = await real_import(sandbox_id, archive)
            await h.client.delete(f"/v1/sandboxes/{sandbox_id}", headers=headers)
            return result

        fakes["n2"].import_archive = deleted_meanwhile  # type: ignore[method-assign]
        await background_round(ctx)
        assert sid not in fakes["n2"].boxes  # the copy made for a deleted row is gone
        gone = await h.client.get(f"/v1/sandboxes/{sid}", headers=headers)
        assert gone.status_code == 404
        await background_round(ctx)
        assert store.objects == {}


async def test_a_stored_snapshot_makes_sandboxes_on_another_node_and_restores_there(
    tmp_path: Path,
) -> None:
    store = FakeArchiveStore()
    async with _cluster(tmp_path, "n1", "n2", store=store) as (h, fakes, clock):
        headers = h.key("acme")
        await _heartbeat(h, "n2", archives=True, room=0)
        sid = (await _create(h, headers))["id"]
        fakes["n1"].boxes[sid].files["/data"] = b"v1"
        taken = await h.client.post(
            f"/v1/sandboxes/{sid}/snapshots", json={"name": "s1"}, headers=headers
        )
        snap = taken.json()
        assert taken.status_code == 201 and not snap["archived"]
        await background_round(_ctx(h))
        listed = await _get(h, f"/v1/snapshots/{snap['id']}", headers)
        assert listed["archived"] and snapshot_archive(snap["id"]) in store.objects

        await _lose(h, clock, "n1", "n2")
        made = await _create(h, headers, from_snapshot=snap["id"])
        assert made["node_id"] == "n2" and made["head_snapshot"] == snap["id"]
        assert fakes["n2"].boxes[made["id"]].files["/data"] == b"v1"
        assert ("fetch_snapshot", snap["id"]) in fakes["n2"].calls
        # The copy stays for later creates and restores, and reconciliation keeps it.
        await reconcile(_ctx(h))
        assert snap["id"] in fakes["n2"].snapshots
        fakes["n2"].boxes[made["id"]].files["/data"] = b"v2"
        restored = await h.client.post(
            f"/v1/sandboxes/{made['id']}/restore", json={"snapshot_id": snap["id"]}, headers=headers
        )
        assert restored.status_code == 200, restored.text
        assert fakes["n2"].boxes[made["id"]].files["/data"] == b"v1"

        # Deleted: its bundle goes, and so does the copy at the next reconciliation.
        deleted = await h.client.delete(f"/v1/snapshots/{snap['id']}", headers=headers)
        assert deleted.status_code == 204  # its own node is lost: not waited for
        await background_round(_ctx(h))
        await reconcile(_ctx(h))
        assert snap["id"] not in fakes["n2"].snapshots
        assert snapshot_archive(snap["id"]) not in store.objects
        # The lost node back: its own copy is nobody's any more.
        await _heartbeat(h, "n1", archives=True)
        assert snap["id"] not in fakes["n1"].snapshots


async def test_negative_a_snapshot_not_in_the_store_is_used_on_its_own_node_only(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    fakes = {"n1": FakeNode("n1"), "n2": FakeNode("n2")}  # no store anywhere
    async with _replica(tmp_path, fakes, clock) as h:
        headers = h.key("acme")
        await _heartbeat(h, "n1")
        sid = (await _create(h, headers))["id"]
        await _heartbeat(h, "n2")
        snap = (
            await h.client.post(
                f"/v1/sandboxes/{sid}/snapshots", json={"name": "s1"}, headers=headers
            )
        ).json()
        await background_round(_ctx(h))
        assert not (await _get(h, f"/v1/snapshots/{snap['id']}", headers))["archived"]
        made = await _create(h, headers, from_snapshot=snap["id"])
        assert made["node_id"] == "n1"  # its own node, though n2 has fewer sandboxes

        clock.now += h.settings.node_lease_s + 1
        await _heartbeat(h, "n2")
        await background_round(_ctx(h))
        refused = await h.client.post(
            "/v1/sandboxes", json={"from_snapshot": snap["id"]}, headers=headers
        )
        assert refused.status_code == 503
        assert "artifact store" in refused.json()["error"]["message"]
        assert fakes["n2"].calls == [c for c in fakes["n2"].calls if c[0] != "fetch_snapshot"]


async def test_a_stored_snapshot_of_a_draining_node_makes_sandboxes_elsewhere(
    tmp_path: Path,
) -> None:
    store = FakeArchiveStore()
    async with _cluster(tmp_path, "n1", "n2", store=store) as (h, fakes, _clock):
        headers = h.key("acme")
        await _heartbeat(h, "n2", archives=True, room=0)
        sid = (await _create(h, headers))["id"]
        snap = (
            await h.client.post(
                f"/v1/sandboxes/{sid}/snapshots", json={"name": "s"}, headers=headers
            )
        ).json()
        await _heartbeat(h, "n2", archives=True)
        await h.client.post("/v1/nodes/n1/drain", headers=_token(h))
        made = await _create(h, headers, from_snapshot=snap["id"])
        assert made["node_id"] == "n1"  # not stored yet: its draining node is the only one
        await background_round(_ctx(h))  # stores it
        made = await _create(h, headers, from_snapshot=snap["id"])
        assert made["node_id"] == "n2" and ("fetch_snapshot", snap["id"]) in fakes["n2"].calls
