"""Pause and resume through the REST API and the node API, over a FakeNode."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from space.node.api import Conflict, ExecRequest, NotFound, SandboxSpec, SandboxState, Unavailable
from tests.unit.fakes import FakeNode, Harness, control_app
from tests.unit.test_remote_node import remote

# DB-level: each test runs on SQLite and on PostgreSQL (issue 19).
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("on_both_databases")]


async def _sandbox(h: Harness, headers: dict[str, str]) -> str:
    response = await h.client.post("/v1/sandboxes", json={}, headers=headers)
    assert response.status_code == 201, response.text
    sandbox_id: str = response.json()["id"]
    return sandbox_id


async def _state(h: Harness, sid: str, headers: dict[str, str]) -> Any:
    return (await h.client.get(f"/v1/sandboxes/{sid}", headers=headers)).json()["state"]


def _put_in_error(h: Harness, sid: str) -> None:
    box = h.node.boxes[sid]
    box.status = replace(box.status, state=SandboxState.ERROR, error="VM exited")


async def test_pause_and_resume_answer_200_with_the_sandbox_and_store_its_state(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = await _sandbox(h, key)

        paused = await h.client.post(f"/v1/sandboxes/{sid}/pause", headers=key)
        assert (paused.status_code, paused.json()["state"]) == (200, "paused")
        assert paused.json()["id"] == sid
        assert await _state(h, sid, key) == "paused"
        assert h.node.boxes[sid].status.state == SandboxState.PAUSED
        listed = (await h.client.get("/v1/sandboxes", headers=key)).json()["sandboxes"]
        assert [s["state"] for s in listed] == ["paused"]

        resumed = await h.client.post(f"/v1/sandboxes/{sid}/resume", headers=key)
        assert (resumed.status_code, resumed.json()["state"]) == (200, "running")
        assert await _state(h, sid, key) == "running"
        assert h.node.boxes[sid].status.state == SandboxState.RUNNING


async def test_pause_and_resume_are_idempotent(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = await _sandbox(h, key)
        for action, state in [("pause", "paused")] * 2 + [("resume", "running")] * 2:
            answer = await h.client.post(f"/v1/sandboxes/{sid}/{action}", headers=key)
            assert (answer.status_code, answer.json()["state"]) == (200, state)


async def test_exec_and_files_on_a_paused_sandbox_resume_it_and_record_running(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = await _sandbox(h, key)
        url = f"/v1/sandboxes/{sid}"
        await h.client.post(f"{url}/pause", headers=key)

        ran = await h.client.post(f"{url}/exec", json={"argv": ["echo", "hi"]}, headers=key)
        assert ran.status_code == 200 and '"exit"' in ran.text
        assert await _state(h, sid, key) == "running"

        await h.client.post(f"{url}/pause", headers=key)
        wrote = await h.client.put(f"{url}/files", params={"path": "/f"}, content=b"x", headers=key)
        assert wrote.status_code == 200, wrote.text
        assert await _state(h, sid, key) == "running"
        assert h.node.boxes[sid].files["/f"] == b"x"


@pytest.mark.parametrize(
    ("path", "body", "verb"),
    [
        ("pause", None, "pause"),
        ("resume", None, "resume"),
        ("hibernate", None, "hibernate"),
        ("snapshots", {"name": "s"}, "snapshot"),
        ("fork", {"count": 1}, "fork"),
    ],
)
async def test_negative_lifecycle_calls_on_a_sandbox_in_error_are_409_naming_the_state(
    tmp_path: Path, path: str, body: dict[str, object] | None, verb: str
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        h.node.fail_create = Unavailable("boot failed")
        failed = await h.client.post("/v1/sandboxes", json={}, headers=key)
        sid = failed.json()["error"]["details"]["sandbox_id"]
        calls = list(h.node.calls)
        answer = await h.client.post(f"/v1/sandboxes/{sid}/{path}", json=body, headers=key)
        error = answer.json()["error"]
        assert answer.status_code == 409
        assert (error["code"], error["details"]["state"]) == ("conflict", "error")
        assert error["message"] == f"cannot {verb} sandbox {sid}: it is error"
        assert h.node.calls == calls  # refused before the node was asked
        assert await _state(h, sid, key) == "error"


async def test_negative_a_node_conflict_on_pause_is_409_and_leaves_the_row(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = await _sandbox(h, key)
        _put_in_error(h, sid)  # the node knows better than the row
        answer = await h.client.post(f"/v1/sandboxes/{sid}/pause", headers=key)
        assert answer.status_code == 409
        assert "it is error" in answer.json()["error"]["message"]
        assert await _state(h, sid, key) == "running"


async def test_negative_pause_and_resume_of_another_tenants_sandbox_are_404(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        owner, intruder = h.key("a"), h.key("b")
        sid = await _sandbox(h, owner)
        for action in ("pause", "resume"):
            answer = await h.client.post(f"/v1/sandboxes/{sid}/{action}", headers=intruder)
            assert answer.status_code == 404
            assert answer.json()["error"]["code"] == "not_found"
        assert await _state(h, sid, owner) == "running"
        assert h.node.boxes[sid].status.state == SandboxState.RUNNING


async def test_negative_pause_of_a_deleted_sandbox_is_404(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("t")
        sid = await _sandbox(h, key)
        await h.client.delete(f"/v1/sandboxes/{sid}", headers=key)
        answer = await h.client.post(f"/v1/sandboxes/{sid}/pause", headers=key)
        assert answer.status_code == 404


async def test_pause_and_resume_round_trip_through_the_node_api() -> None:
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        assert (await client.pause_sandbox("sb-1")).state is SandboxState.PAUSED
        assert (await client.get_sandbox("sb-1")).state is SandboxState.PAUSED
        assert (await client.resume_sandbox("sb-1")).state is SandboxState.RUNNING
        with pytest.raises(NotFound):
            await client.pause_sandbox("sb-missing")
        await client.pause_sandbox("sb-1")
        stream = await client.exec("sb-1", ExecRequest(argv=["echo", "x"]))
        await stream.aclose()
        assert node.boxes["sb-1"].status.state is SandboxState.RUNNING
        box = node.boxes["sb-1"]
        box.status = replace(box.status, state=SandboxState.ERROR)
        with pytest.raises(Conflict, match="it is error"):
            await client.resume_sandbox("sb-1")
