"""``Idempotency-Key`` on creates and forks (issue 19), on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session

from space.control import quota_checks
from space.control.reconcile import reap
from space.control.store import idempotency as store
from space.control.store.idempotency import IdempotencyRecord
from space.limits import IDEMPOTENCY_KEY_TTL_S
from space.node.api import InsufficientCapacity, SandboxSpec, SandboxStatus
from tests.unit.fakes import FakeClock, FakeNode, Harness, control_app

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("on_both_databases")]


class SlowNode(FakeNode):
    """A node whose creates take a while, so that concurrent requests overlap."""

    async def create_sandbox(self, spec: SandboxSpec) -> SandboxStatus:
        await asyncio.sleep(0.2)
        return await super().create_sandbox(spec)


async def _create(
    h: Harness, headers: dict[str, str], key: str | None, body: dict[str, Any] | None = None
) -> httpx.Response:
    extra = {} if key is None else {"Idempotency-Key": key}
    return await h.client.post("/v1/sandboxes", json=body or {}, headers={**headers, **extra})


async def test_a_retried_create_answers_the_same_sandbox_and_makes_no_second(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        acme = h.key("acme")
        first = await _create(h, acme, "create-1", {"metadata": {"a": "1"}, "cpus": 2})
        # The same request, its keys in another order: the same request.
        again = await _create(h, acme, "create-1", {"cpus": 2, "metadata": {"a": "1"}})
        assert first.status_code == again.status_code == 201
        assert again.json() == first.json()
        assert list(h.node.boxes) == [first.json()["id"]]
        other = await _create(h, acme, "create-2", {"metadata": {"a": "1"}, "cpus": 2})
        assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
        listed = (await h.client.get("/v1/sandboxes", headers=acme)).json()["sandboxes"]
        assert len(listed) == 2


async def test_concurrent_creates_with_one_key_through_two_replicas_make_one_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[str] = []

    def claim(session: Session, record: IdempotencyRecord, now: float) -> None:
        try:
            store.claim(session, record, now)
        except store.KeyTaken:
            taken.append(record.key)
            raise

    monkeypatch.setattr(quota_checks, "claim_key", claim)
    node = SlowNode()
    async with contextlib.AsyncExitStack() as stack:
        replicas = [
            await stack.enter_async_context(control_app(tmp_path / name, node))
            for name in ("a", "b")
        ]
        acme = replicas[0].key("acme")
        answers = await asyncio.gather(
            *(_create(replicas[i % 2], acme, "race", {"cpus": 1}) for i in range(6))
        )
    assert [a.status_code for a in answers] == [201] * 6
    assert {a.json()["id"] for a in answers} == set(node.boxes)
    assert len(node.boxes) == 1
    assert all(a.json()["state"] == "running" for a in answers)
    assert taken  # the race reached the database: a claim lost on the key's row


async def test_negative_a_key_reused_with_another_body_is_422_and_makes_nothing(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        acme = h.key("acme")
        assert (await _create(h, acme, "k", {"cpus": 1})).status_code == 201
        before = set(h.node.boxes)
        reused = await _create(h, acme, "k", {"cpus": 2})
        assert reused.status_code == 422
        error = reused.json()["error"]
        assert error["code"] == "invalid_argument" and "another request" in error["message"]
        assert set(h.node.boxes) == before


async def test_keys_are_the_tenants_own(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        mine = await _create(h, h.key("acme"), "shared")
        theirs = await _create(h, h.key("beta"), "shared")
        assert mine.status_code == theirs.status_code == 201
        assert mine.json()["id"] != theirs.json()["id"]


async def test_a_key_expires_after_a_day_and_the_reaper_forgets_it(tmp_path: Path) -> None:
    clock = FakeClock()
    async with control_app(tmp_path, clock=clock) as h:
        acme = h.key("acme")
        first = (await _create(h, acme, "daily", {"timeout_s": None})).json()["id"]
        clock.now += IDEMPOTENCY_KEY_TTL_S - 1
        assert (await _create(h, acme, "daily", {"timeout_s": None})).json()["id"] == first
        clock.now += 1
        await reap(h.app.state.ctx)  # swept
        second = (await _create(h, acme, "daily", {"timeout_s": None})).json()["id"]
        assert second != first and set(h.node.boxes) == {first, second}


async def test_a_create_no_node_had_room_for_gives_its_key_back(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        acme = h.key("acme")
        h.node.fail_create = InsufficientCapacity("full", resource="memory")
        refused = await _create(h, acme, "later")
        assert refused.status_code == 503 and h.node.boxes == {}
        h.node.fail_create = None
        retried = await _create(h, acme, "later")
        assert retried.status_code == 201 and list(h.node.boxes) == [retried.json()["id"]]


async def test_a_retried_fork_answers_the_same_children(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        acme = h.key("acme")
        parent = (await _create(h, acme, None)).json()["id"]
        url = f"/v1/sandboxes/{parent}/fork"
        headers = {**acme, "Idempotency-Key": "fork-1"}
        first = await h.client.post(url, json={"count": 2}, headers=headers)
        again = await h.client.post(url, json={"count": 2}, headers=headers)
        assert first.status_code == again.status_code == 201
        assert again.json() == first.json() and len(first.json()["sandboxes"]) == 2
        assert len(h.node.boxes) == 3
        # The same key for a create is another request.
        assert (await _create(h, acme, "fork-1")).status_code == 422


@pytest.mark.parametrize(
    ("key", "status"),
    [("k" * 255, 201), ("a b~!", 201), ("k" * 256, 422), ("", 422)],
)
async def test_keys_are_1_to_255_printable_characters(
    tmp_path: Path, key: str, status: int
) -> None:
    async with control_app(tmp_path) as h:
        answer = await _create(h, h.key("acme"), key)
        assert answer.status_code == status
        if status == 422:
            assert "Idempotency-Key" in answer.json()["error"]["message"]
            assert h.node.boxes == {}
