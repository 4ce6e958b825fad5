"""Hibernate, timeouts and guest activity through the REST API, over a FakeNode.

Time is the harness's FakeClock; reaper rounds are run directly (``reap``), never by
sleeping.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from space.control.deps import ControlContext
from space.control.reconcile import notice_failed_vms, reap
from space.node.api import SandboxState, SandboxStatus, Unavailable
from tests.unit.fakes import Harness, control_app

# DB-level: each test runs on SQLite and on PostgreSQL (issue 19).
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("on_both_databases")]


def _ctx(h: Harness) -> ControlContext:
    ctx: ControlContext = h.app.state.ctx
    return ctx


async def _create(h: Harness, key: dict[str, str], **body: Any) -> dict[str, Any]:
    response = await h.client.post("/v1/sandboxes", json=body, headers=key)
    assert response.status_code == 201, response.text
    sandbox: dict[str, Any] = response.json()
    return sandbox


async def _get(h: Harness, sid: str, key: dict[str, str]) -> dict[str, Any]:
    response = await h.client.get(f"/v1/sandboxes/{sid}", headers=key)
    assert response.status_code == 200, response.text
    sandbox: dict[str, Any] = response.json()
    return sandbox


async def _exec(h: Harness, sid: str, key: dict[str, str]) -> None:
    ran = await h.client.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["echo"]}, headers=key)
    assert ran.status_code == 200 and '"exit"' in ran.text, ran.text


async def test_a_new_sandbox_shows_its_timeouts_and_no_activity_yet(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sandbox = await _create(h, key, idle_timeout_s=60, timeout_s=3600)
        assert sandbox["idle_timeout_s"] == 60
        assert sandbox["max_lifetime_s"] == 3600
        assert sandbox["last_active_at"] is None and sandbox["head_snapshot"] is None
        plain = await _create(h, key)
        assert (plain["idle_timeout_s"], plain["max_lifetime_s"]) == (None, 300)
        forever = await _create(h, key, timeout_s=None)
        assert forever["max_lifetime_s"] is None and forever["expires_at"] is None


async def test_hibernate_answers_the_sandbox_hibernated_and_is_idempotent(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        for _ in range(2):
            answer = await h.client.post(f"/v1/sandboxes/{sid}/hibernate", headers=key)
            assert (answer.status_code, answer.json()["state"]) == (200, "hibernated")
        assert (await _get(h, sid, key))["state"] == "hibernated"
        assert h.node.boxes[sid].status.state is SandboxState.HIBERNATED


async def test_a_paused_sandbox_can_be_hibernated_and_resume_wakes_a_hibernated_one(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        await h.client.post(f"/v1/sandboxes/{sid}/pause", headers=key)
        hibernated = await h.client.post(f"/v1/sandboxes/{sid}/hibernate", headers=key)
        assert hibernated.json()["state"] == "hibernated"
        resumed = await h.client.post(f"/v1/sandboxes/{sid}/resume", headers=key)
        assert (resumed.status_code, resumed.json()["state"]) == (200, "running")
        assert resumed.json()["last_active_at"] is not None  # resume counts as activity
        assert h.node.boxes[sid].status.state is SandboxState.RUNNING


async def test_negative_pause_of_a_hibernated_sandbox_is_409_naming_the_state(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        await h.client.post(f"/v1/sandboxes/{sid}/hibernate", headers=key)
        answer = await h.client.post(f"/v1/sandboxes/{sid}/pause", headers=key)
        assert answer.status_code == 409
        assert answer.json()["error"]["message"] == f"cannot pause sandbox {sid}: it is hibernated"


async def test_a_guest_call_on_a_hibernated_sandbox_resumes_it_and_records_running(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        await h.client.post(f"/v1/sandboxes/{sid}/hibernate", headers=key)
        listed = await h.client.get(f"/v1/sandboxes/{sid}/files/list?path=/", headers=key)
        assert listed.status_code == 200, listed.text
        assert (await _get(h, sid, key))["state"] == "running"
        assert h.node.boxes[sid].status.state is SandboxState.RUNNING


async def test_guest_calls_record_activity_at_most_once_a_second(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        start = h.clock.now
        await _exec(h, sid, key)
        first = (await _get(h, sid, key))["last_active_at"]
        h.clock.now = start + 0.5
        await _exec(h, sid, key)
        assert (await _get(h, sid, key))["last_active_at"] == first  # not rewritten
        h.clock.now = start + 1
        await h.client.get(f"/v1/sandboxes/{sid}/processes", headers=key)
        later = (await _get(h, sid, key))["last_active_at"]
        assert later != first and later.startswith("2027-01-15T08:00:01")


async def test_auto_hibernate_fires_exactly_at_the_idle_boundary(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key, idle_timeout_s=60))["id"]
        h.clock.now += 59
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "running"
        h.clock.now += 1
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "hibernated"
        assert h.node.boxes[sid].status.state is SandboxState.HIBERNATED


async def test_activity_postpones_auto_hibernate(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key, idle_timeout_s=60))["id"]
        h.clock.now += 30
        await _exec(h, sid, key)
        h.clock.now += 59  # 89 s after creation, 59 s after the exec
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "running"
        h.clock.now += 1
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "hibernated"


async def test_an_open_exec_stream_keeps_the_sandbox_from_auto_hibernating(
    tmp_path: Path,
) -> None:
    # httpx's ASGI transport buffers whole responses, so the stream is driven directly.
    async def lines() -> AsyncIterator[bytes]:
        yield b"start"
        yield b"exit"

    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key, idle_timeout_s=60))["id"]
        stream = _ctx(h).activity.watch(sid, lines())
        assert await anext(stream) == b"start"
        h.clock.now += 120  # a command silent for longer than the idle timeout
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "running"
        assert [line async for line in stream] == [b"exit"]
        h.clock.now += 59  # its output was activity
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "running"
        h.clock.now += 1
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "hibernated"


async def test_a_paused_sandbox_also_auto_hibernates_and_a_guest_call_then_resumes_it(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key, idle_timeout_s=10))["id"]
        await h.client.post(f"/v1/sandboxes/{sid}/pause", headers=key)
        h.clock.now += 10
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "hibernated"
        await _exec(h, sid, key)
        sandbox = await _get(h, sid, key)
        assert sandbox["state"] == "running" and sandbox["last_active_at"] is not None
        h.clock.now += 9
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "running"


async def test_changing_timeouts_while_running_takes_effect_on_the_next_round(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        h.clock.now += 100
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "running"
        put = await h.client.put(
            f"/v1/sandboxes/{sid}/timeouts", json={"idle_timeout_s": 100}, headers=key
        )
        assert put.status_code == 200, put.text
        assert (put.json()["idle_timeout_s"], put.json()["max_lifetime_s"]) == (100, 300)
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "hibernated"


async def test_timeouts_can_be_removed_and_the_lifetime_counts_from_creation(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key, idle_timeout_s=5, timeout_s=60))["id"]
        url = f"/v1/sandboxes/{sid}/timeouts"
        h.clock.now += 30
        body = {"idle_timeout_s": None, "max_lifetime_s": 2592000}
        answer = (await h.client.put(url, json=body, headers=key)).json()
        assert (answer["idle_timeout_s"], answer["max_lifetime_s"]) == (None, 2592000)
        h.clock.now += 1000
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "running"
        unchanged = (await h.client.put(url, json={}, headers=key)).json()
        assert (unchanged["idle_timeout_s"], unchanged["max_lifetime_s"]) == (None, 2592000)
        await h.client.put(url, json={"max_lifetime_s": 1030}, headers=key)  # = its age
        await reap(_ctx(h))
        assert (await h.client.get(f"/v1/sandboxes/{sid}", headers=key)).status_code == 404
        assert sid not in h.node.boxes


async def test_expiry_deletes_a_hibernated_sandbox(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key, timeout_s=60))["id"]
        await h.client.post(f"/v1/sandboxes/{sid}/hibernate", headers=key)
        h.clock.now += 60
        await reap(_ctx(h))
        assert sid not in h.node.boxes


async def test_negative_a_node_failing_to_hibernate_leaves_the_row_for_the_next_round(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key, idle_timeout_s=1))["id"]
        h.clock.now += 1
        h.node.fail_next = Unavailable("node busy")
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "running"
        await reap(_ctx(h))
        assert (await _get(h, sid, key))["state"] == "hibernated"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"idle_timeout_s": 0}, "idle_timeout_s"),
        ({"idle_timeout_s": 604801}, "idle_timeout_s"),
        ({"max_lifetime_s": 0}, "max_lifetime_s"),
        ({"max_lifetime_s": 2592001}, "max_lifetime_s"),
        ({"idle_timeout_s": "60"}, "idle_timeout_s"),
        ({"idle_timeout_s": 60, "timeout_s": 5}, "timeout_s"),
    ],
)
async def test_negative_timeouts_out_of_range_are_422_and_change_nothing(
    tmp_path: Path, body: dict[str, Any], field: str
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key, idle_timeout_s=7))["id"]
        before = await _get(h, sid, key)
        answer = await h.client.put(f"/v1/sandboxes/{sid}/timeouts", json=body, headers=key)
        assert answer.status_code == 422
        error = answer.json()["error"]
        assert error["code"] == "invalid_argument" and field in error["message"]
        assert await _get(h, sid, key) == before


async def test_timeouts_at_their_upper_limits_are_accepted(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key, idle_timeout_s=604800))["id"]
        body = {"idle_timeout_s": 1, "max_lifetime_s": 1}
        answer = await h.client.put(f"/v1/sandboxes/{sid}/timeouts", json=body, headers=key)
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("idle", [0, 604801])
async def test_negative_create_with_an_idle_timeout_out_of_range_is_422(
    tmp_path: Path, idle: int
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        answer = await h.client.post("/v1/sandboxes", json={"idle_timeout_s": idle}, headers=key)
        assert answer.status_code == 422
        assert "idle_timeout_s" in answer.json()["error"]["message"]
        assert h.node.boxes == {}


async def test_negative_timeouts_of_a_deleted_sandbox_are_404(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]
        await h.client.delete(f"/v1/sandboxes/{sid}", headers=key)
        body = {"idle_timeout_s": 5}
        answer = await h.client.put(f"/v1/sandboxes/{sid}/timeouts", json=body, headers=key)
        assert answer.status_code == 404


async def test_timeouts_can_be_set_on_a_sandbox_in_error(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        h.node.fail_create = Unavailable("boot failed")
        failed = await h.client.post("/v1/sandboxes", json={}, headers=key)
        sid = failed.json()["error"]["details"]["sandbox_id"]
        body = {"max_lifetime_s": 10}
        answer = await h.client.put(f"/v1/sandboxes/{sid}/timeouts", json=body, headers=key)
        assert answer.status_code == 200 and answer.json()["max_lifetime_s"] == 10


async def test_a_vm_its_node_saw_exit_is_recorded_as_error_with_the_reason(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        running, paused, healthy = [(await _create(h, key))["id"] for _ in range(3)]
        assert (await h.client.post(f"/v1/sandboxes/{paused}/pause", headers=key)).is_success
        for sid in (running, paused):
            box = h.node.boxes[sid]
            box.status = replace(
                box.status, state=SandboxState.ERROR, error="VM exited unexpectedly; oom"
            )
        await reap(_ctx(h))
        for sid in (running, paused):
            failed = await _get(h, sid, key)
            assert (failed["state"], failed["error"]) == ("error", "VM exited unexpectedly; oom")
        assert (await _get(h, healthy, key))["state"] == "running"


async def test_negative_a_node_that_cannot_list_its_sandboxes_changes_no_row(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = (await _create(h, key))["id"]

        async def unreachable() -> list[SandboxStatus]:
            raise Unavailable("node unreachable")

        h.node.list_sandboxes = unreachable  # type: ignore[method-assign]
        assert await notice_failed_vms(_ctx(h)) == []
        assert (await _get(h, sid, key))["state"] == "running"


async def test_the_row_keeps_the_guest_type_its_node_resolved_and_gvisor_takes_an_idle_timeout(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        assert (await _create(h, key))["guest"] == "qemu"  # auto, resolved by the node
        sid = (await _create(h, key, guest="gvisor"))["id"]
        assert (await _get(h, sid, key))["guest"] == "gvisor"
        # A gVisor sandbox hibernates (issue 21): an idle timeout is taken, at create too.
        made = await h.client.post(
            "/v1/sandboxes", json={"guest": "gvisor", "idle_timeout_s": 60}, headers=key
        )
        assert made.status_code == 201, made.text
        assert made.json()["idle_timeout_s"] == 60
        body = {"idle_timeout_s": 60}
        answer = await h.client.put(f"/v1/sandboxes/{sid}/timeouts", json=body, headers=key)
        assert answer.status_code == 200, answer.text
        assert (await _get(h, sid, key))["idle_timeout_s"] == 60
        listed = (await h.client.get("/v1/sandboxes", headers=key)).json()["sandboxes"]
        assert len(listed) == 3
