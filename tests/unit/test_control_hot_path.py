"""What a request costs the control plane's database (issue 21, "Host's share of
latency"): an exec is one read, a create three transactions; a key's verdict is kept
VERDICT_TTL_S; activity marks are written in batches, off the request's path, and
never lost by a replica that stops.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from space.control import keys
from space.control.activity import WRITE_INTERVAL_S
from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.keys import VERDICT_TTL_S, KeyVerdicts, create_key, list_keys, revoke_key
from space.control.store import Database, repo
from tests.unit.fakes import FakeClock, Harness, control_app

# DB-level: each test runs on SQLite and on PostgreSQL (issue 19).
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("on_both_databases")]


def _ctx(h: Harness) -> ControlContext:
    ctx: ControlContext = h.app.state.ctx
    return ctx


@contextmanager
def _counted(db: Database) -> Iterator[collections.Counter[str]]:
    """Count the transactions (``call``) and plain reads (``read_call``) made on ``db``."""
    counts: collections.Counter[str] = collections.Counter()
    real_call, real_read = db.call, db.read_call

    def call(fn: Callable[[Any], Any]) -> Any:
        counts["transactions"] += 1
        return real_call(fn)

    def read_call(fn: Callable[[Any], Any]) -> Any:
        counts["reads"] += 1
        return real_read(fn)

    db.call, db.read_call = call, read_call  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        del db.call, db.read_call


async def _create(h: Harness, key: dict[str, str]) -> str:
    response = await h.client.post("/v1/sandboxes", json={}, headers=key)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def _exec(h: Harness, sid: str, key: dict[str, str]) -> None:
    ran = await h.client.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["echo"]}, headers=key)
    assert ran.status_code == 200 and '"exit"' in ran.text, ran.text


async def _row_activity(h: Harness, sid: str) -> float | None:
    record = await _ctx(h).db.run(lambda s: repo.sandbox_by_id(s, sid))
    assert record is not None
    return record.last_active_at


async def test_an_exec_costs_one_database_read_and_no_transaction(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        sid = await _create(h, key)
        with _counted(_ctx(h).db) as counts:
            await _exec(h, sid, key)
        # The sandbox's lookup; the key's verdict is this replica's, the activity mark
        # is written later.
        assert counts == {"reads": 1}


async def test_a_create_costs_one_read_and_two_transactions(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        await _create(h, key)
        with _counted(_ctx(h).db) as counts:
            await _create(h, key)
        # Placement's read; the row inserted (quotas checked) before the node is asked,
        # and its state after.
        assert counts == {"reads": 1, "transactions": 2}


async def test_negative_a_key_revoked_before_this_replica_saw_it_is_refused_at_once(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = create_key(h.settings, "acme")
        (info,) = list_keys(h.settings, "acme")
        revoke_key(h.settings, info.id)
        for _ in range(2):  # a refusal is never remembered: looked up each time
            response = await h.client.get("/v1/sandboxes", headers={"X-API-Key": key})
            assert response.status_code == 401


def test_a_verdict_lasts_exactly_its_ttl_and_not_across_a_clock_set_back() -> None:
    clock = FakeClock()
    verdicts = KeyVerdicts(clock)
    assert verdicts.tenant("sk_space_a") is None
    verdicts.remember("sk_space_a", "acme")
    clock.now += VERDICT_TTL_S - 0.001
    assert verdicts.tenant("sk_space_a") == "acme"
    assert verdicts.tenant("sk_space_b") is None
    clock.now += 0.001
    assert verdicts.tenant("sk_space_a") is None  # due again at the boundary
    verdicts.remember("sk_space_a", "acme")
    clock.now -= 60  # a wall clock stepped back does not stretch the trust
    assert verdicts.tenant("sk_space_a") is None


def test_verdicts_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys, "_MAX_VERDICTS", 3)
    clock = FakeClock()
    verdicts = KeyVerdicts(clock)
    for name in "abc":
        verdicts.remember(f"sk_space_{name}", "acme")
    verdicts.remember("sk_space_d", "acme")  # all three fresh: dropped, d kept
    assert [verdicts.tenant(f"sk_space_{n}") for n in "abcd"] == [None, None, None, "acme"]
    verdicts.remember("sk_space_e", "acme")
    clock.now += VERDICT_TTL_S
    verdicts.remember("sk_space_f", "acme")
    verdicts.remember("sk_space_g", "acme")  # full: the expired d and e are dropped
    assert [verdicts.tenant(f"sk_space_{n}") for n in "fg"] == ["acme", "acme"]
    assert len(verdicts._valid) == 2


async def test_activity_marks_are_shown_at_once_and_written_together(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        first, second = await _create(h, key), await _create(h, key)
        await _exec(h, first, key)
        await _exec(h, second, key)
        assert await _row_activity(h, first) is None  # not written on the request's path
        shown = (await h.client.get(f"/v1/sandboxes/{first}", headers=key)).json()
        assert shown["last_active_at"] is not None  # this replica shows its marks
        with _counted(_ctx(h).db) as counts:
            await _ctx(h).activity.write()
        assert counts == {"transactions": 1}
        assert await _row_activity(h, first) == await _row_activity(h, second) == h.clock.now


async def test_activity_marks_are_written_within_the_interval_unasked(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        sid = await _create(h, key)
        await _exec(h, sid, key)
        for _ in range(int(WRITE_INTERVAL_S * 40)):  # real time: the writer sleeps
            if await _row_activity(h, sid) is not None:
                break
            await asyncio.sleep(0.05)
        assert await _row_activity(h, sid) == h.clock.now


async def test_a_stopping_replica_writes_its_activity_marks(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        sid = await _create(h, key)
        await _exec(h, sid, key)
        marked = h.clock.now
    async with control_app(tmp_path, h.node) as again:
        assert await _row_activity(again, sid) == marked


async def test_negative_activity_marks_survive_a_database_outage(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        sid = await _create(h, key)
        await _exec(h, sid, key)
        db = _ctx(h).db

        def down(fn: Callable[[Any], Any]) -> Any:
            raise ApiError("unavailable", "database down")

        db.call = down  # type: ignore[method-assign]
        with pytest.raises(ApiError):
            await _ctx(h).activity.write()
        del db.call
        assert await _row_activity(h, sid) is None
        await _ctx(h).activity.write()  # kept, and written once the database is back
        assert await _row_activity(h, sid) == h.clock.now
