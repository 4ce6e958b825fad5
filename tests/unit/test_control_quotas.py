"""Per-tenant quotas through the REST API over a FakeNode (issue 17, "one tenant fills
the node"): each quota admits its last unit and refuses the next with 429 naming the
limit and the use, a refusal stores nothing and asks no node, and one tenant at its
quotas leaves another tenant's work alone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from space.control.build_context import spool_upload
from space.control.quota_admin import set_quotas
from space.control.quotas import QUOTA_NAMES, QuotaLimits
from space.control.reconcile import hibernate_idle
from space.control.store.models import SandboxRow, SnapshotRow
from space.limits import QUOTAS
from space.node.api import BuildEvent, BuildLog, BuildSucceeded
from tests.unit._fake_templates import FakeBuildStream
from tests.unit.fakes import FakeNode, Harness, control_app, wait_for
from tests.unit.test_control_templates import archive, lines, spec

# DB-level: each test runs on SQLite and on PostgreSQL (issue 19).
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("on_both_databases")]


def _limit(h: Harness, tenant: str, **limits: int | None) -> None:
    set_quotas(h.settings, tenant, limits)


async def _create(h: Harness, key: dict[str, str], **body: Any) -> dict[str, Any]:
    answer = await h.client.post("/v1/sandboxes", json=body, headers=key)
    assert answer.status_code == 201, answer.text
    sandbox: dict[str, Any] = answer.json()
    return sandbox


async def _post(h: Harness, url: str, key: dict[str, str], **body: Any) -> httpx.Response:
    return await h.client.post(url, json=body, headers=key)


async def _stored(h: Harness) -> tuple[object, ...]:
    """Every sandbox and snapshot row, for "the database did not change" checks."""

    def read(session: Any) -> tuple[object, ...]:
        boxes = session.execute(select(SandboxRow.id, SandboxRow.state)).all()
        snaps = session.execute(select(SnapshotRow.id, SnapshotRow.state)).all()
        return tuple(sorted(map(tuple, boxes))), tuple(sorted(map(tuple, snaps)))

    stored: tuple[object, ...] = await h.app.state.ctx.db.run(read)
    return stored


def _refused(answer: httpx.Response, quota: str, limit: int, used: int, requested: int) -> None:
    assert answer.status_code == 429, answer.text
    error = answer.json()["error"]
    assert error["code"] == "resource_exhausted"
    assert error["details"] == {
        "quota": quota, "limit": limit, "used": used, "requested": requested,
    }  # fmt: skip
    assert error["message"].startswith(f"quota {quota}: {used} of {limit} ")
    assert error["message"].endswith(f"needs {requested}")


def _node_creates(h: Harness) -> int:
    return sum(1 for method, _ in h.node.calls if method == "create_sandbox")


@pytest.mark.parametrize(
    ("quota", "limit", "body", "each"),
    [
        ("running_sandboxes", 2, {}, 1),
        ("vcpus", 4, {"cpus": 2}, 2),
        ("memory_mib", 1024, {"memory_mib": 512}, 512),
        ("disk_mib", 4096, {"disk_mib": 2048}, 2048),
    ],
)
async def test_negative_a_create_past_a_quota_is_429_after_the_last_one_fits_storing_nothing(
    tmp_path: Path, quota: str, limit: int, body: dict[str, int], each: int
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        _limit(h, "acme", **{quota: limit})
        for _ in range(limit // each):  # exactly up to the limit: all admitted
            await _create(h, key, **body)
        before, creates = await _stored(h), _node_creates(h)
        answer = await _post(h, "/v1/sandboxes", key, **body, metadata={"big": "x" * 1000})
        _refused(answer, quota, limit, limit, each)
        assert await _stored(h) == before and _node_creates(h) == creates


async def test_tenant_a_at_its_quota_leaves_tenant_b_creating_and_running(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        a, b = h.key("acme"), h.key("beta")
        _limit(h, "acme", running_sandboxes=1, suspended_sandboxes=1)
        first = await _create(h, a)
        assert (await _post(h, f"/v1/sandboxes/{first['id']}/hibernate", a)).status_code == 200
        await _create(h, a)
        assert (await _post(h, "/v1/sandboxes", a)).status_code == 429
        # B has the defaults, and runs as if A were not there.
        mine = await _create(h, b)
        ran = await _post(h, f"/v1/sandboxes/{mine['id']}/exec", b, argv=["echo", "hi"])
        assert ran.status_code == 200
        assert json.loads(ran.text.splitlines()[-1])["type"] == "exit"
        assert len([await _create(h, b) for _ in range(3)]) == 3


async def test_negative_waking_a_hibernated_sandbox_past_the_running_quota_is_refused_until_one_goes(  # noqa: E501
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        _limit(h, "acme", running_sandboxes=1)
        sleeper = await _create(h, key)
        await _post(h, f"/v1/sandboxes/{sleeper['id']}/hibernate", key)
        other = await _create(h, key)  # the one running place, taken
        before = await _stored(h)
        answer = await _post(h, f"/v1/sandboxes/{sleeper['id']}/resume", key)
        _refused(answer, "running_sandboxes", 1, 1, 1)
        # A guest operation wakes it too: refused the same way, the node not asked.
        calls = len(h.node.calls)
        answer = await _post(h, f"/v1/sandboxes/{sleeper['id']}/exec", key, cmd="true")
        _refused(answer, "running_sandboxes", 1, 1, 1)
        assert await _stored(h) == before and len(h.node.calls) == calls
        await h.client.delete(f"/v1/sandboxes/{other['id']}", headers=key)
        woken = await _post(h, f"/v1/sandboxes/{sleeper['id']}/resume", key)
        assert woken.status_code == 200 and woken.json()["state"] == "running"


async def test_resuming_a_paused_sandbox_at_the_running_quota_takes_nothing_more(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        _limit(h, "acme", running_sandboxes=1)
        box = await _create(h, key)
        await _post(h, f"/v1/sandboxes/{box['id']}/pause", key)
        resumed = await _post(h, f"/v1/sandboxes/{box['id']}/resume", key)
        assert resumed.status_code == 200 and resumed.json()["state"] == "running"


async def test_negative_hibernating_past_the_suspended_quota_is_refused(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        _limit(h, "acme", suspended_sandboxes=1)
        first, second = await _create(h, key), await _create(h, key)
        assert (await _post(h, f"/v1/sandboxes/{first['id']}/hibernate", key)).status_code == 200
        answer = await _post(h, f"/v1/sandboxes/{second['id']}/hibernate", key)
        _refused(answer, "suspended_sandboxes", 1, 1, 1)
        assert h.node.boxes[second["id"]].status.state.value == "running"
        # Hibernating the hibernated one again is idempotent, not a second place.
        assert (await _post(h, f"/v1/sandboxes/{first['id']}/hibernate", key)).status_code == 200


async def test_negative_a_fork_counts_every_child_and_makes_none_past_the_quota(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        _limit(h, "acme", running_sandboxes=4)
        parent = await _create(h, key)
        before, calls = await _stored(h), len(h.node.calls)
        answer = await _post(h, f"/v1/sandboxes/{parent['id']}/fork", key, count=4)
        _refused(answer, "running_sandboxes", 4, 1, 4)
        assert await _stored(h) == before and len(h.node.calls) == calls
        forked = await _post(h, f"/v1/sandboxes/{parent['id']}/fork", key, count=3)
        assert forked.status_code == 201 and len(forked.json()["sandboxes"]) == 3


async def test_negative_a_snapshot_past_the_snapshots_quota_is_refused_storing_nothing(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        _limit(h, "acme", snapshots=2)
        box = await _create(h, key)
        for name in ("one", "two"):
            url = f"/v1/sandboxes/{box['id']}/snapshots"
            assert (await _post(h, url, key, name=name)).status_code == 201
        before, taken = await _stored(h), dict(h.node.snapshots)
        answer = await _post(h, f"/v1/sandboxes/{box['id']}/snapshots", key, name="three")
        _refused(answer, "snapshots", 2, 2, 1)
        assert await _stored(h) == before and h.node.snapshots == taken


async def test_negative_a_create_from_a_snapshot_counts_against_the_quotas(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        _limit(h, "acme", memory_mib=768)
        box = await _create(h, key, memory_mib=512)
        url = f"/v1/sandboxes/{box['id']}/snapshots"
        snapshot = (await _post(h, url, key, name="s")).json()
        answer = await _post(h, "/v1/sandboxes", key, from_snapshot=snapshot["id"])
        _refused(answer, "memory_mib", 768, 512, 512)


async def test_a_tenants_own_limit_can_be_put_back_to_the_default(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        _limit(h, "acme", running_sandboxes=0)
        assert (await _post(h, "/v1/sandboxes", key)).status_code == 429
        _limit(h, "acme", running_sandboxes=None)
        await _create(h, key)


async def test_get_quota_answers_each_limit_and_what_the_tenant_uses(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        _limit(h, "acme", vcpus=7)
        box = await _create(h, key, cpus=2, memory_mib=512, disk_mib=4096)
        await _create(h, key)
        await _post(h, f"/v1/sandboxes/{box['id']}/hibernate", key)
        await _post(h, f"/v1/sandboxes/{box['id']}/snapshots", key, name="s")
        answer = await h.client.get("/v1/quota", headers=key)
        assert answer.status_code == 200
        quotas = answer.json()["quotas"]
        assert list(quotas) == [quota.name for quota in QUOTAS]
        used = {name: q["used"] for name, q in quotas.items()}
        assert used == {
            "running_sandboxes": 1, "suspended_sandboxes": 1, "vcpus": 1,
            "memory_mib": 256, "disk_mib": 4096 + 2048, "snapshots": 1,
            "templates": 0, "builds": 0,
        }  # fmt: skip
        defaults = QuotaLimits()
        assert quotas["vcpus"] == {"limit": 7, "used": 1, "unit": "vCPUs"}
        assert quotas["running_sandboxes"]["limit"] == defaults.running_sandboxes
        # Another tenant's use and limits are its own.
        theirs = (await h.client.get("/v1/quota", headers=h.key("beta"))).json()["quotas"]
        assert theirs["vcpus"] == {"limit": defaults.vcpus, "used": 0, "unit": "vCPUs"}


async def test_negative_get_quota_without_a_key_is_401(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        assert (await h.client.get("/v1/quota")).status_code == 401


def test_every_quota_has_a_default_limit_and_the_names_are_written_once() -> None:
    assert {quota.name for quota in QUOTAS} == QUOTA_NAMES
    assert all(QuotaLimits().of(quota) > 0 for quota in QUOTAS)
    with pytest.raises(ValueError, match="quota vcpus must be a whole number >= 0"):
        QuotaLimits(vcpus=-1)


# --- templates and builds -----------------------------------------------------------------


class _HeldBuilds(FakeNode):
    """A FakeNode whose builds stream their first line, then wait for ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def build_template(self, context: AsyncIterable[bytes]) -> FakeBuildStream:
        stream = await super().build_template(context)
        return _HeldStream(stream, self.release)


class _HeldStream(FakeBuildStream):
    def __init__(self, inner: FakeBuildStream, release: asyncio.Event) -> None:
        super().__init__(inner.build_id, [])
        self._inner = inner
        self._release = release

    async def __aiter__(self) -> AsyncIterator[BuildEvent]:
        async for event in self._inner:
            if isinstance(event, BuildSucceeded | BuildLog) and not self._release.is_set():
                await self._release.wait()
            yield event


class _Body:
    """A streamed request body that records how many bytes were taken from it."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self.sent += len(self.data)
        yield self.data


async def test_negative_a_build_past_the_builds_quota_is_refused_before_its_body_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spooled: list[int] = []

    async def counting_spool(chunks: AsyncIterable[bytes], limit_bytes: int) -> Any:
        spooled.append(1)
        return await spool_upload(chunks, limit_bytes)

    monkeypatch.setattr("space.control.routers.templates.spool_upload", counting_spool)
    node = _HeldBuilds()
    async with control_app(tmp_path, node) as h:
        key = h.key("acme")
        _limit(h, "acme", builds=1)
        first = asyncio.create_task(h.client.post("/v1/templates", content=archive(), headers=key))
        await wait_for(lambda: len(node.build_streams) == 1)  # its build runs on the node
        assert spooled == [1] and h.app.state.ctx.slots.builds("acme") == 1
        body = _Body(archive(spec("other")))
        answer = await h.client.post("/v1/templates", content=body, headers=key)
        _refused(answer, "builds", 1, 1, 1)
        assert body.sent == 0 and spooled == [1]  # refused from the headers alone
        # Another tenant builds meanwhile.
        theirs = asyncio.create_task(
            h.client.post("/v1/templates", content=archive(), headers=h.key("beta"))
        )
        await wait_for(lambda: len(node.build_streams) == 2)
        node.release.set()
        assert lines(await first)[-1]["type"] == "template"
        assert lines(await theirs)[-1]["type"] == "template"
        assert h.app.state.ctx.slots.builds("acme") == 0  # the slot is back
        again = await h.client.post("/v1/templates", content=archive(spec("other")), headers=key)
        assert lines(again)[-1]["type"] == "template"


async def test_negative_a_build_adding_a_template_past_the_templates_quota_is_refused(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        _limit(h, "acme", templates=2)
        for name, tag in (("py", "v1"), ("py", "v2")):
            built = await h.client.post(
                "/v1/templates", content=archive(spec(name, tag)), headers=key
            )
            assert lines(built)[-1]["type"] == "template"
        contexts = len(h.node.contexts)
        answer = await h.client.post("/v1/templates", content=archive(spec("js")), headers=key)
        _refused(answer, "templates", 2, 2, 1)
        assert len(h.node.contexts) == contexts  # no node was asked to build
        # Rebuilding an existing name:tag adds none: allowed at the quota.
        rebuilt = await h.client.post(
            "/v1/templates", content=archive(spec("py", "v2")), headers=key
        )
        assert lines(rebuilt)[-1]["type"] == "template"
        assert h.app.state.ctx.slots.builds("acme") == 0
        quotas = (await h.client.get("/v1/quota", headers=key)).json()["quotas"]
        assert quotas["templates"] == {"limit": 2, "used": 2, "unit": "templates"}


async def test_rows_counted_for_quotas_do_not_include_error_or_deleted_sandboxes(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        _limit(h, "acme", running_sandboxes=1)
        box = await _create(h, key)
        await h.client.delete(f"/v1/sandboxes/{box['id']}", headers=key)
        await _create(h, key)  # the deleted one no longer counts
        count = await h.app.state.ctx.db.run(
            lambda s: s.execute(select(func.count()).select_from(SandboxRow)).scalar_one()
        )
        assert count == 2


async def test_the_reaper_leaves_an_idle_sandbox_running_past_the_suspended_quota(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        _limit(h, "acme", suspended_sandboxes=1)
        first = await _create(h, key, idle_timeout_s=60)
        second = await _create(h, key, idle_timeout_s=120)
        h.clock.now += 60
        assert await hibernate_idle(h.app.state.ctx) == [first["id"]]
        h.clock.now += 60  # the second is idle too, but the one suspended place is taken
        assert await hibernate_idle(h.app.state.ctx) == []
        assert h.node.boxes[second["id"]].status.state.value == "running"


async def test_concurrent_wakes_at_the_running_quota_admit_exactly_one(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        boxes = [await _create(h, key) for _ in range(3)]
        for box in boxes:
            await _post(h, f"/v1/sandboxes/{box['id']}/hibernate", key)
        _limit(h, "acme", running_sandboxes=1)
        answers = await asyncio.gather(
            *(_post(h, f"/v1/sandboxes/{box['id']}/resume", key) for box in boxes),
            _post(h, "/v1/sandboxes", key),
        )
        assert sorted(answer.status_code for answer in answers) == [200, 429, 429, 429]
        running = [b for b in h.node.boxes.values() if b.status.state.value == "running"]
        assert len(running) == 1
