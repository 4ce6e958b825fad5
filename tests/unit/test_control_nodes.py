"""Issue 19 on the control plane: node heartbeats and leases, lost nodes, placement,
drain, and background work that runs once across replicas over one database."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from space.control import ControlSettings, NodeRegistry, background
from space.control.background import background_round, job_lease_s
from space.control.deps import ControlContext
from space.control.reconcile import hibernate_idle, reconcile
from space.control.scheduler import rank_nodes
from space.control.store import Database, job_leases
from space.control.store import nodes as node_rows
from space.control.store.models import JobLeaseRow
from space.control.store.repo import SandboxRecord, insert_sandbox
from space.node.api import (
    ExportTicket,
    ImportResult,
    InsufficientCapacity,
    InvalidArgument,
    NodeService,
    SandboxState,
)
from tests.unit.fakes import FakeClock, FakeNode, Harness, control_app

# DB-level: each test runs on SQLite and on PostgreSQL.
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("on_both_databases")]

_CAPACITY: dict[str, Any] = {
    "vcpus": 8,
    "memory_mib": 32768,
    "memory_available_mib": 30000,
    "disk_mib": 102400,
    "disk_free_mib": 90000,
    "guest_types": ["qemu"],
    "room": 40,
    "templates": ["base"],
    "pools": {},
    "archives": False,
}


def _ctx(h: Harness) -> ControlContext:
    ctx: ControlContext = h.app.state.ctx
    return ctx


def _token(h: Harness) -> dict[str, str]:
    return {"Authorization": f"Bearer {h.settings.token_file.read_text().strip()}"}


async def _heartbeat(h: Harness, node_id: str, **capacity: Any) -> dict[str, Any]:
    body = {"node_id": node_id, "url": f"http://{node_id}:8081", "capacity": _CAPACITY | capacity}
    answer = await h.client.post("/v1/nodes", json=body, headers=_token(h))
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


async def _nodes(h: Harness) -> dict[str, dict[str, Any]]:
    listed = (await h.client.get("/v1/nodes", headers=_token(h))).json()["nodes"]
    return {out["node_id"]: out for out in listed}


@contextlib.asynccontextmanager
async def _replica(
    data_dir: Path, fakes: dict[str, FakeNode], clock: FakeClock
) -> AsyncIterator[Harness]:
    """A control-plane replica with no embedded node: it reaches the FakeNode of each
    registered ``http://<id>:8081`` directly. Replicas of one ``data_dir`` share its
    database (SQLite there, or the test's PostgreSQL), node token and master key."""

    def remote(url: str, token: str) -> NodeService:
        return fakes[url.removeprefix("http://").partition(":")[0]]

    registry = NodeRegistry(remote_factory=remote)
    async with control_app(data_dir, FakeNode("unused"), registry=registry, clock=clock) as h:
        yield h


@pytest.fixture
def database(tmp_path: Path, on_both_databases: str) -> Iterator[Database]:
    db = Database(on_both_databases or f"sqlite:///{tmp_path / 'space.db'}")
    db.upgrade()
    try:
        yield db
    finally:
        db.dispose()


# job leases


def test_a_job_lease_has_one_holder_until_it_runs_out_or_is_released(database: Database) -> None:
    def take(holder: str, now: float) -> bool:
        return database.call(lambda s: job_leases.take(s, "reaper", holder, now, 10.0))

    assert take("r1", 100.0) and take("r1", 105.0)  # renewed by its holder
    assert not take("r2", 114.0)  # r1's lease runs to 115
    assert take("r2", 115.5) and not take("r1", 116.0)
    database.call(lambda s: job_leases.release(s, "r2"))
    assert take("r1", 117.0)


async def test_replicas_racing_for_a_job_lease_give_it_to_exactly_one(database: Database) -> None:
    async def take(holder: str) -> bool:
        return await database.run(lambda s: job_leases.take(s, "reap", holder, 100.0, 10.0))

    for round_ in range(5):
        holders = [f"r{round_}-{i}" for i in range(6)]
        won = await asyncio.gather(*(take(holder) for holder in holders))
        assert sum(won) == (1 if round_ == 0 else 0)  # later rounds: still the first's


# heartbeats, leases, lost nodes


async def test_a_heartbeat_renews_the_nodes_lease_and_tells_it_how_often(tmp_path: Path) -> None:
    clock, fakes = FakeClock(), {"far": FakeNode("far")}
    async with _replica(tmp_path, fakes, clock) as h:
        answer = await _heartbeat(h, "far")
        settings = h.settings
        assert answer["heartbeat_s"] == settings.node_heartbeat_s
        assert answer["lease_s"] == settings.node_lease_s
        far = (await _nodes(h))["far"]
        assert far["state"] == "active" and far["reachable"] is True
        assert far["lease_expires_at"] == clock.now + settings.node_lease_s
        assert far["reported"] == _CAPACITY
        clock.now += 20
        await _heartbeat(h, "far", room=3)
        far = (await _nodes(h))["far"]
        assert far["lease_expires_at"] == clock.now + settings.node_lease_s
        assert far["reported"]["room"] == 3


@pytest.mark.parametrize(
    "change",
    [
        {"vcpus": 0},
        {"room": -1},
        {"guest_types": []},
        {"guest_types": ["QEMU;rm"]},
        {"templates": ["x" * 161]},
        {"templates": ["t"] * 1025},
        {"memory_mib": 2**41},
        {"surprise": 1},
    ],
)
async def test_negative_a_malformed_capacity_report_is_refused_and_stores_nothing(
    tmp_path: Path, change: dict[str, Any]
) -> None:
    async with _replica(tmp_path, {"far": FakeNode("far")}, FakeClock()) as h:
        body = {"node_id": "far", "url": "http://far:8081", "capacity": _CAPACITY | change}
        refused = await h.client.post("/v1/nodes", json=body, headers=_token(h))
        assert refused.status_code == 422
        assert await _nodes(h) == {}


async def test_a_node_whose_lease_runs_out_is_lost_with_its_sandboxes_and_comes_back(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    far, near = FakeNode("far"), FakeNode("near")
    async with _replica(tmp_path, {"far": far, "near": near}, clock) as h:
        headers = h.key("acme")
        await _heartbeat(h, "far")
        sid = (await h.client.post("/v1/sandboxes", json={}, headers=headers)).json()["id"]
        assert sid in far.boxes
        await _heartbeat(h, "near")
        clock.now += h.settings.node_lease_s - 1
        await _heartbeat(h, "near")
        await background_round(_ctx(h))
        assert (await _nodes(h))["far"]["state"] == "active"  # not yet run out
        clock.now += 2
        await background_round(_ctx(h))

        assert (await _nodes(h))["far"]["state"] == "lost"
        row = (await h.client.get(f"/v1/sandboxes/{sid}", headers=headers)).json()
        assert row["state"] == "lost" and "far" in row["error"]
        assert sid in far.boxes  # said plainly, never removed
        refused = await h.client.post(f"/v1/sandboxes/{sid}/pause", headers=headers)
        assert refused.status_code == 409 and "lost" in refused.json()["error"]["message"]
        # New sandboxes go to a node that holds its lease.
        other = (await h.client.post("/v1/sandboxes", json={}, headers=headers)).json()
        assert other["node_id"] == "near"

        await _heartbeat(h, "far")  # back: reconciled from what it reports
        assert (await _nodes(h))["far"]["state"] == "active"
        row = (await h.client.get(f"/v1/sandboxes/{sid}", headers=headers)).json()
        assert row["state"] == "running"


async def test_a_lost_sandbox_deleted_is_deleted_on_its_node_when_the_node_comes_back(
    tmp_path: Path,
) -> None:
    clock, far = FakeClock(), FakeNode("far")
    async with _replica(tmp_path, {"far": far}, clock) as h:
        headers = h.key("acme")
        await _heartbeat(h, "far")
        sid = (await h.client.post("/v1/sandboxes", json={}, headers=headers)).json()["id"]
        clock.now += h.settings.node_lease_s + 1
        await background_round(_ctx(h))
        far.calls.clear()
        deleted = await h.client.delete(f"/v1/sandboxes/{sid}", headers=headers)
        assert deleted.status_code == 204
        assert far.calls == [] and sid in far.boxes  # a lost node is not waited for
        await _heartbeat(h, "far")
        assert sid not in far.boxes


async def test_an_embedded_node_is_heartbeat_by_its_own_replica(tmp_path: Path) -> None:
    clock = FakeClock()
    async with control_app(tmp_path, clock=clock) as h:
        lease = (await _nodes(h))["local"]["lease_expires_at"]
        assert lease == clock.now + h.settings.node_lease_s
        clock.now += 10 * h.settings.node_lease_s
        await background_round(_ctx(h))  # heartbeats first: never lost while it runs
        local = (await _nodes(h))["local"]
        assert local["state"] == "active"
        assert local["lease_expires_at"] == clock.now + h.settings.node_lease_s


def test_negative_a_heartbeat_not_shorter_than_the_lease_is_refused(tmp_path: Path) -> None:
    for heartbeat_s, lease_s in ((30.0, 30.0), (0.0, 30.0), (40.0, 30.0)):
        with pytest.raises(InvalidArgument, match="heartbeat"):
            ControlSettings(data_dir=tmp_path, node_heartbeat_s=heartbeat_s, node_lease_s=lease_s)


# placement and drain


def _record(node_id: str, state: str = "active", **capacity: Any) -> node_rows.NodeRecord:
    return node_rows.NodeRecord(node_id, "u", state, 1.0, 1.0, _CAPACITY | capacity)


def test_placement_by_room_then_pool_then_ready_state_then_spread() -> None:
    nodes = [
        _record("full", room=0, pools={"py": 3}, templates=["py"]),
        _record("pooled", pools={"py": 2}),
        _record("empty-pool", pools={"py": 0}),
        _record("built", templates=["base", "py"]),
        _record("busy"),
        _record("idle"),
        _record("draining", "draining", pools={"py": 5}),
        _record("lost", "lost", pools={"py": 5}),
        _record("unreachable", pools={"py": 5}),
    ]
    reachable = [n.id for n in nodes if n.id != "unreachable"]
    load = {"busy": 5, "idle": 1, "empty-pool": 3}
    ranked = rank_nodes(nodes, load, reachable=reachable, template="py")
    assert ranked == ["pooled", "built", "idle", "empty-pool", "busy", "full"]
    # From a snapshot (no template): spread alone, still room first.
    ranked = rank_nodes(nodes, load, reachable=reachable, template=None)
    assert ranked == ["built", "pooled", "idle", "empty-pool", "busy", "full"]
    unreported = node_rows.NodeRecord("old", "u", "active", None, None, None)
    assert rank_nodes([unreported, nodes[0]], {}, reachable=["old", "full"]) == ["old", "full"]
    assert rank_nodes(nodes, load, reachable=[]) == []


async def test_a_drained_node_gets_no_new_sandboxes_until_activated(tmp_path: Path) -> None:
    clock = FakeClock()
    first, second = FakeNode("n1"), FakeNode("n2")
    async with _replica(tmp_path, {"n1": first, "n2": second}, clock) as h:
        headers = h.key("acme")
        await _heartbeat(h, "n1")
        await _heartbeat(h, "n2")
        drained = await h.client.post("/v1/nodes/n1/drain", headers=_token(h))
        assert drained.status_code == 200 and drained.json()["state"] == "draining"
        for _ in range(3):
            created = await h.client.post("/v1/sandboxes", json={}, headers=headers)
            assert created.json()["node_id"] == "n2"
        await _heartbeat(h, "n1")  # a heartbeat does not undo a drain
        assert (await _nodes(h))["n1"]["state"] == "draining"
        activated = await h.client.post("/v1/nodes/n1/activate", headers=_token(h))
        assert activated.json()["state"] == "active"
        created = await h.client.post("/v1/sandboxes", json={}, headers=headers)
        assert created.json()["node_id"] == "n1"


async def test_negative_drain_of_an_unknown_or_lost_node_or_without_the_token_is_refused(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    async with _replica(tmp_path, {"far": FakeNode("far")}, clock) as h:
        unknown = await h.client.post("/v1/nodes/nowhere/drain", headers=_token(h))
        assert unknown.status_code == 404
        await _heartbeat(h, "far")
        tenant = await h.client.post("/v1/nodes/far/drain", headers=h.key("acme"))
        assert tenant.status_code == 401
        clock.now += h.settings.node_lease_s + 1
        await background_round(_ctx(h))
        lost = await h.client.post("/v1/nodes/far/drain", headers=_token(h))
        assert lost.status_code == 409 and lost.json()["error"]["details"]["state"] == "lost"
        assert (await _nodes(h))["far"]["state"] == "lost"


# replicas


async def test_two_replicas_reap_an_expired_sandbox_exactly_once(tmp_path: Path) -> None:
    clock, node = FakeClock(), FakeNode("n1")
    async with (
        _replica(tmp_path, {"n1": node}, clock) as first,
        _replica(tmp_path, {"n1": node}, clock) as second,
    ):
        await _heartbeat(first, "n1")
        headers = first.key("acme")
        body = {"timeout_s": 60}
        sid = (await first.client.post("/v1/sandboxes", json=body, headers=headers)).json()["id"]
        # The second replica serves the same sandbox.
        seen = await second.client.get(f"/v1/sandboxes/{sid}", headers=headers)
        assert seen.json()["state"] == "running"
        clock.now += 61
        await _heartbeat(second, "n1")
        node.calls.clear()
        await asyncio.gather(background_round(_ctx(first)), background_round(_ctx(second)))
        assert node.calls.count(("delete_sandbox", sid)) == 1
        gone = await second.client.get(f"/v1/sandboxes/{sid}", headers=headers)
        assert gone.status_code == 404


async def test_a_replica_takes_the_jobs_of_one_that_stopped_renewing(tmp_path: Path) -> None:
    clock, node = FakeClock(), FakeNode("n1")
    stacks = [contextlib.AsyncExitStack(), contextlib.AsyncExitStack()]
    try:
        replicas = [
            await stack.enter_async_context(_replica(tmp_path, {"n1": node}, clock))
            for stack in stacks
        ]
        for h in replicas:
            await background_round(_ctx(h))
        db = _ctx(replicas[0]).db
        holder = await db.run(lambda s: s.get(JobLeaseRow, "reaper"))
        assert holder is not None
        dying = [_ctx(h).replica_id for h in replicas].index(holder.holder)
        survivor = replicas[1 - dying]
        await _heartbeat(survivor, "n1")
        headers = survivor.key("acme")
        body = {"timeout_s": 60}
        created = await survivor.client.post("/v1/sandboxes", json=body, headers=headers)
        sid = created.json()["id"]
        clock.now += 61
        await _heartbeat(survivor, "n1")
        await background_round(_ctx(survivor))
        assert sid in node.boxes  # the reaper is the other's
        # The holder dies without giving its leases up (kill -9).
        _ctx(replicas[dying]).replica_id = "replica-gone"
        await stacks[dying].aclose()
        await background_round(_ctx(survivor))
        assert sid in node.boxes  # its lease has not run out yet
        clock.now += job_lease_s(survivor.settings.reaper_interval_s) + 1
        await _heartbeat(survivor, "n1")
        await background_round(_ctx(survivor))
        assert sid not in node.boxes
    finally:
        for stack in stacks:
            await stack.aclose()


async def test_a_replica_renews_its_job_leases_once_a_quarter_of_them_has_run(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    async with _replica(tmp_path, {"n1": FakeNode("n1")}, clock) as h:
        ctx, ttl = _ctx(h), job_lease_s(h.settings.reaper_interval_s)

        async def expiries() -> dict[str, float]:
            """Of the jobs of every round (reconciling is due once a minute)."""
            rows = await ctx.db.run(lambda s: s.query(JobLeaseRow).all())
            assert {row.holder for row in rows} == {ctx.replica_id}
            return {row.name: row.expires_at for row in rows if row.name != "reconcile"}

        await background_round(ctx)
        taken = await expiries()
        assert len(taken) >= 5 and set(taken.values()) == {clock.now + ttl}
        clock.now += 0.25 * ttl - 0.5
        await background_round(ctx)
        assert await expiries() == taken  # three quarters left: no write
        clock.now += 1.0
        await background_round(ctx)
        assert set((await expiries()).values()) == {clock.now + ttl}
        # Given up at shutdown, they are taken again at once, by a write.
        await background.release_jobs(ctx)
        assert await ctx.db.run(lambda s: s.query(JobLeaseRow).count()) == 0
        await background_round(ctx)
        assert set((await expiries()).values()) == {clock.now + ttl}


async def test_a_stream_open_in_one_replica_keeps_the_sandbox_from_anothers_idle_reaper(
    tmp_path: Path,
) -> None:
    clock, node = FakeClock(), FakeNode("n1")
    async with (
        _replica(tmp_path, {"n1": node}, clock) as first,
        _replica(tmp_path, {"n1": node}, clock) as second,
    ):
        await _heartbeat(first, "n1")
        headers = first.key("acme")
        body = {"idle_timeout_s": 60}
        sid = (await first.client.post("/v1/sandboxes", json=body, headers=headers)).json()["id"]
        gate = asyncio.Event()

        async def silent() -> AsyncIterator[bytes]:
            await gate.wait()
            yield b""

        stream = _ctx(first).activity.watch(sid, silent())
        reading = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        clock.now += 61
        await _ctx(first).activity.mark_streamed()
        assert await hibernate_idle(_ctx(second)) == []
        gate.set()
        await reading
        await stream.aclose()  # type: ignore[attr-defined]
        clock.now += 61
        await _ctx(first).activity.mark_streamed()  # nothing streams any more
        assert await hibernate_idle(_ctx(second)) == [sid]


async def test_reconciliation_leaves_a_young_creating_row_to_its_replica(tmp_path: Path) -> None:
    clock = FakeClock()
    async with control_app(tmp_path, clock=clock) as h:
        h.key("acme")  # the tenant exists

        def row(sandbox_id: str, created_at: float) -> SandboxRecord:
            return SandboxRecord(
                id=sandbox_id, tenant_id="acme", node_id="local", template="base", cpus=1,
                memory_mib=256, disk_mib=2048, env={}, metadata={},
                state=SandboxState.CREATING.value, desired_state="running",
                created_at=created_at, expires_at=None,
            )  # fmt: skip

        young, old = (
            row("sb-young", clock.now - 5),
            row("sb-old", clock.now - h.settings.reconcile_grace_s - 1),
        )
        for record in (young, old):
            await _ctx(h).db.run(functools.partial(insert_sandbox, record=record))
        await reconcile(_ctx(h))
        states = {
            sid: (await h.client.get(f"/v1/sandboxes/{sid}", headers=h.key("acme"))).json()
            for sid in ("sb-young", "sb-old")
        }
        assert states["sb-young"]["state"] == "creating"
        assert states["sb-old"]["state"] == "error"
        # Alone (a start on SQLite), nothing is in flight: everything half made settles.
        await reconcile(_ctx(h), grace_s=0.0)
        settled = await h.client.get("/v1/sandboxes/sb-young", headers=h.key("acme"))
        assert settled.json()["state"] == "error"


# drain: suspended sandboxes move off a draining node


class _MovingNode(FakeNode):
    """A fake node that imports a sandbox by taking it from the fake at the source URL
    (what a real target pulls as a btrfs stream)."""

    def __init__(self, node_id: str, fakes: dict[str, FakeNode]) -> None:
        super().__init__(node_id)
        self.fakes = fakes

    async def import_sandbox(self, ticket: ExportTicket, source_url: str) -> ImportResult:
        source = self.fakes[source_url.removeprefix("http://").partition(":")[0]]
        box = source.boxes[ticket.sandbox_id]
        status = dataclasses.replace(box.status, state=SandboxState.HIBERNATED)
        self.boxes[ticket.sandbox_id] = box.copy(status)
        return ImportResult(status, 4096, None)

    async def finish_export(self, sandbox_id: str, ticket: str, *, moved: bool) -> None:
        await super().finish_export(sandbox_id, ticket, moved=moved)
        if moved:
            del self.boxes[sandbox_id]


async def test_a_drained_node_s_suspended_sandboxes_move_to_another_node(tmp_path: Path) -> None:
    clock, fakes = FakeClock(), dict[str, FakeNode]()
    fakes.update({n: _MovingNode(n, fakes) for n in ("n1", "n2")})
    async with _replica(tmp_path, fakes, clock) as h:
        headers = h.key("acme")
        await _heartbeat(h, "n1")
        made = [
            (await h.client.post("/v1/sandboxes", json={}, headers=headers)).json()["id"]
            for _ in range(3)
        ]
        await _heartbeat(h, "n2", room=0)  # n2 joins later: everything is on n1
        running, paused, hibernated = made
        await h.client.post(f"/v1/sandboxes/{paused}/pause", headers=headers)
        await h.client.post(f"/v1/sandboxes/{hibernated}/hibernate", headers=headers)
        fakes["n1"].boxes[hibernated].files["/tmp/kept"] = b"here"

        assert (await h.client.post("/v1/nodes/n1/drain", headers=_token(h))).status_code == 200
        await background_round(_ctx(h))

        rows = {sid: (await h.client.get(f"/v1/sandboxes/{sid}", headers=headers)).json()
                for sid in made}  # fmt: skip
        assert rows[running]["node_id"] == "n1" and rows[running]["state"] == "running"
        for sid in (paused, hibernated):
            assert rows[sid]["node_id"] == "n2" and rows[sid]["state"] == "hibernated"
            assert sid in fakes["n2"].boxes and sid not in fakes["n1"].boxes
        assert fakes["n2"].boxes[hibernated].files["/tmp/kept"] == b"here"
        assert sorted(fakes["n1"].finished) == sorted([(paused, True), (hibernated, True)])
        # A guest call wakes it where it is now.
        woke = await h.client.post(f"/v1/sandboxes/{hibernated}/resume", headers=headers)
        assert woke.json()["state"] == "running" and woke.json()["node_id"] == "n2"


async def test_negative_a_failed_import_leaves_the_sandbox_on_its_node(tmp_path: Path) -> None:
    clock = FakeClock()
    fakes = {"n1": FakeNode("n1"), "n2": FakeNode("n2")}  # n2 imports nothing
    async with _replica(tmp_path, fakes, clock) as h:
        headers = h.key("acme")
        await _heartbeat(h, "n1")
        sid = (await h.client.post("/v1/sandboxes", json={}, headers=headers)).json()["id"]
        await _heartbeat(h, "n2")
        await h.client.post(f"/v1/sandboxes/{sid}/hibernate", headers=headers)
        await h.client.post("/v1/nodes/n1/drain", headers=_token(h))
        await background_round(_ctx(h))
        row = (await h.client.get(f"/v1/sandboxes/{sid}", headers=headers)).json()
        assert row["node_id"] == "n1" and row["state"] == "hibernated"
        assert sid in fakes["n1"].boxes and fakes["n1"].finished == [(sid, False)]
        assert fakes["n1"].exports == {}  # released: it can be woken or moved again


class _FullNode(_MovingNode):
    """A target whose admission has no room: it refuses every import (their ids in
    ``refused``)."""

    def __init__(self, node_id: str, fakes: dict[str, FakeNode]) -> None:
        super().__init__(node_id, fakes)
        self.refused: list[str] = []

    async def import_sandbox(self, ticket: ExportTicket, source_url: str) -> ImportResult:
        self.refused.append(ticket.sandbox_id)
        raise InsufficientCapacity(
            "node has no room for 1 more VM: pool is short by 1 MiB",
            sandbox_id=ticket.sandbox_id, resource="pool", needed=1664, available=1663,
        )  # fmt: skip


async def test_a_drain_passes_over_a_target_without_room_to_the_next(tmp_path: Path) -> None:
    clock, fakes = FakeClock(), dict[str, FakeNode]()
    full = _FullNode("n2", fakes)
    fakes.update({"n1": _MovingNode("n1", fakes), "n2": full, "n3": _MovingNode("n3", fakes)})
    async with _replica(tmp_path, fakes, clock) as h:
        headers = h.key("acme")
        await _heartbeat(h, "n1")
        sid = (await h.client.post("/v1/sandboxes", json={}, headers=headers)).json()["id"]
        # n2 reports room (stale) and ranks first (fewer sandboxes, then by id).
        await _heartbeat(h, "n2")
        await _heartbeat(h, "n3")
        await h.client.post(f"/v1/sandboxes/{sid}/pause", headers=headers)
        await h.client.post("/v1/nodes/n1/drain", headers=_token(h))
        await background_round(_ctx(h))
        row = (await h.client.get(f"/v1/sandboxes/{sid}", headers=headers)).json()
        assert row["node_id"] == "n3" and row["state"] == "hibernated"
        assert full.refused == [sid] and sid not in full.boxes
        assert sid in fakes["n3"].boxes and sid not in fakes["n1"].boxes
        # The refusal let the export go on; the move to n3 then finished it.
        assert fakes["n1"].finished == [(sid, False), (sid, True)]


async def test_negative_a_drain_with_no_target_with_room_leaves_the_sandbox_whole(
    tmp_path: Path,
) -> None:
    clock, fakes = FakeClock(), dict[str, FakeNode]()
    full = _FullNode("n2", fakes)
    fakes.update({"n1": _MovingNode("n1", fakes), "n2": full})
    async with _replica(tmp_path, fakes, clock) as h:
        headers = h.key("acme")
        await _heartbeat(h, "n1")
        sid = (await h.client.post("/v1/sandboxes", json={}, headers=headers)).json()["id"]
        await _heartbeat(h, "n2", room=0)
        await h.client.post(f"/v1/sandboxes/{sid}/hibernate", headers=headers)
        fakes["n1"].boxes[sid].files["/tmp/kept"] = b"here"
        await h.client.post("/v1/nodes/n1/drain", headers=_token(h))
        for _ in range(2):  # each round asks again; the sandbox stays where it is
            await background_round(_ctx(h))
        row = (await h.client.get(f"/v1/sandboxes/{sid}", headers=headers)).json()
        assert row["node_id"] == "n1" and row["state"] == "hibernated"
        assert full.refused == [sid, sid] and fakes["n1"].exports == {}
        assert fakes["n1"].boxes[sid].files["/tmp/kept"] == b"here"
        woke = await h.client.post(f"/v1/sandboxes/{sid}/resume", headers=headers)
        assert woke.json()["state"] == "running" and woke.json()["node_id"] == "n1"
