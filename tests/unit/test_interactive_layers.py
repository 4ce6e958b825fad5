"""Interactive stdin, PTY sizes, process tags and directory watches (issue 20) through
each host layer over a FakeNode: the node's HTTP API and RemoteNode, the REST API, the
SDK."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import space.limits
import space.protocol
from space.node.api import (
    Conflict,
    ExecRequest,
    InvalidArgument,
    NotFound,
    PtySize,
    SandboxSpec,
    WatchEvent,
)
from space.sdk import PtySize as SdkPtySize
from space.sdk.errors import Conflict as SdkConflict
from space.sdk.errors import InvalidArgument as SdkInvalidArgument
from space.sdk.errors import NotFound as SdkNotFound
from tests.unit._live_api import LiveApi
from tests.unit._sdk_calls import create as _create
from tests.unit.fakes import FakeNode, Harness, control_app
from tests.unit.test_remote_node import remote

pytestmark = pytest.mark.anyio


def test_the_shared_limits_are_the_guest_protocols_own() -> None:
    assert space.limits.MAX_STDIN_BYTES == space.protocol.MAX_INPUT_BYTES
    assert space.limits.MAX_PTY_SIZE == space.protocol.MAX_PTY_SIZE
    assert space.limits.PROCESS_TAG_PATTERN == space.protocol.TAG_PATTERN
    assert space.limits.MAX_PROCESS_PID == space.protocol.MAX_PID


async def test_remote_node_carries_open_stdin_pty_tag_input_and_resize() -> None:
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        request = ExecRequest(
            cmd="sh", open_stdin=True, pty=PtySize(30, 90), tag="shell", background=True
        )
        stream = await client.exec("sb-1", request)
        await stream.aclose()
        assert await client.write_stdin("sb-1", "p1", b"\x00\xffls\n") == 5
        assert await client.write_stdin("sb-1", "p1", b"", eof=True) == 0
        await client.resize_pty("sb-1", "p1", PtySize(50, 200))
        listed = await client.list_processes("sb-1")
        with pytest.raises(Conflict, match="closed"):
            await client.write_stdin("sb-1", "p1", b"x")
        with pytest.raises(NotFound):
            await client.write_stdin("sb-1", "p9", b"x")
        with pytest.raises(InvalidArgument):
            await client.resize_pty("sb-1", "p1", PtySize(0, 10))
    assert node.stdin[("sb-1", "p1")] == b"\x00\xffls\n"
    assert node.pty_sizes[("sb-1", "p1")] == PtySize(50, 200)
    assert (listed[0].tag, listed[0].pty) == ("shell", True)


async def _sandbox(h: Harness) -> tuple[str, dict[str, str]]:
    headers = h.key("acme")
    response = await h.client.post("/v1/sandboxes", json={}, headers=headers)
    assert response.status_code == 201, response.text
    return f"/v1/sandboxes/{response.json()['id']}", headers


async def test_rest_stdin_takes_raw_bytes_and_eof_and_resize_takes_a_size(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        url, headers = await _sandbox(h)
        body: dict[str, Any] = {"cmd": "bash", "pty": {"rows": 10, "cols": 20}, "tag": "t-1"}
        started = await h.client.post(
            f"{url}/exec", json={**body, "background": True}, headers=headers
        )
        assert json.loads(started.text.splitlines()[0])["process_id"] == "p1"
        sent = await h.client.post(f"{url}/processes/p1/stdin", content=b"ab\x03", headers=headers)
        assert (sent.status_code, sent.json()) == (200, {"bytes": 3})
        closed = await h.client.post(
            f"{url}/processes/p1/stdin", params={"eof": "true"}, headers=headers
        )
        assert closed.json() == {"bytes": 0}
        resized = await h.client.post(
            f"{url}/processes/p1/resize", json={"rows": 1000, "cols": 1}, headers=headers
        )
        assert resized.status_code == 204
        tagged = await h.client.get(f"{url}/processes", params={"tag": "t-1"}, headers=headers)
        other = await h.client.get(f"{url}/processes", params={"tag": "x"}, headers=headers)
    sid = url.rsplit("/", 1)[1]
    assert h.node.stdin[(sid, "p1")] == b"ab\x03" and (sid, "p1") in h.node.stdin_closed
    assert h.node.pty_sizes[(sid, "p1")] == PtySize(1000, 1)
    assert [(p["tag"], p["pty"]) for p in tagged.json()["processes"]] == [("t-1", True)]
    assert other.json()["processes"] == []


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("exec", {"cmd": "x", "pty": {"rows": 0, "cols": 80}}, 422, "invalid_argument"),
        ("exec", {"cmd": "x", "pty": {"rows": 24, "cols": 1001}}, 422, "invalid_argument"),
        ("exec", {"cmd": "x", "tag": "has space"}, 422, "invalid_argument"),
        ("exec", {"cmd": "x", "tag": "t" * 65}, 422, "invalid_argument"),
        ("exec", {"cmd": "x", "stdin": "a", "open_stdin": True}, 422, "invalid_argument"),
        ("processes/p1/resize", {"rows": 24, "cols": 0}, 422, "invalid_argument"),
        ("processes/p9/resize", {"rows": 24, "cols": 80}, 404, "not_found"),
    ],
)
async def test_negative_bad_pty_sizes_tags_and_unknown_processes_are_refused(
    tmp_path: Path, path: str, body: dict[str, Any], status: int, code: str
) -> None:
    async with control_app(tmp_path) as h:
        url, headers = await _sandbox(h)
        await h.client.post(f"{url}/exec", json={"cmd": "sh", "pty": {}}, headers=headers)
        before = dict(h.node.pty_sizes)
        response = await h.client.post(f"{url}/{path}", json=body, headers=headers)
        assert (response.status_code, response.json()["error"]["code"]) == (status, code)
        assert h.node.pty_sizes == before  # nothing changed
        assert len(h.node.boxes[url.rsplit("/", 1)[1]].processes) == 1


async def test_negative_stdin_over_the_cap_or_to_a_process_without_one_is_refused(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        url, headers = await _sandbox(h)
        await h.client.post(
            f"{url}/exec",
            json={"cmd": "cat", "open_stdin": True, "background": True},
            headers=headers,
        )
        await h.client.post(
            f"{url}/exec", json={"cmd": "plain", "background": True}, headers=headers
        )
        cap = space.limits.MAX_STDIN_BYTES
        at_cap = await h.client.post(
            f"{url}/processes/p1/stdin", content=b"x" * cap, headers=headers
        )
        over = await h.client.post(
            f"{url}/processes/p1/stdin", content=b"x" * (cap + 1), headers=headers
        )
        plain = await h.client.post(f"{url}/processes/p2/stdin", content=b"x", headers=headers)
        missing = await h.client.post(f"{url}/processes/p9/stdin", content=b"x", headers=headers)
    assert at_cap.json() == {"bytes": cap}
    assert over.status_code == 413
    assert (plain.status_code, missing.status_code) == (409, 404)
    sid = url.rsplit("/", 1)[1]
    assert len(h.node.stdin[(sid, "p1")]) == cap  # the refused body wrote nothing


async def test_sdk_feeds_a_background_process_resizes_and_connects_by_tag(api: LiveApi) -> None:
    async with await _create(api) as sandbox:
        handle = await sandbox.commands.run(
            "bash", background=True, pty=SdkPtySize(rows=5, cols=6), tag="term"
        )
        assert api.exec_bodies[-1]["pty"] == {"rows": 5, "cols": 6}
        await handle.send_stdin("héllo")
        await handle.send_stdin(b"x" * (space.limits.MAX_STDIN_BYTES + 1))  # two requests
        await handle.resize(SdkPtySize(rows=7, cols=8))
        again = await sandbox.commands.connect(tag="term")
        await again.close_stdin()
        listed = await sandbox.commands.list()
        with pytest.raises(SdkConflict):
            await sandbox.commands.send_stdin(handle.process_id, "late")
        with pytest.raises(SdkNotFound):
            await sandbox.commands.connect(tag="nobody")
        with pytest.raises(SdkInvalidArgument):
            await sandbox.commands.resize_pty(handle.process_id, SdkPtySize(rows=0, cols=8))
        key = (sandbox.sandbox_id, handle.process_id)
    assert again.process_id == handle.process_id
    assert bytes(api.node.stdin[key]).startswith("héllo".encode())
    assert len(api.node.stdin[key]) == len("héllo".encode()) + space.limits.MAX_STDIN_BYTES + 1
    assert api.node.pty_sizes[key] == PtySize(7, 8)
    assert (listed[0].tag, listed[0].pty) == ("term", True)


async def test_sdk_on_start_gives_a_foreground_run_its_handle(api: LiveApi) -> None:
    handles: list[Any] = []
    async with await _create(api) as sandbox:
        result = await sandbox.commands.run("cat", open_stdin=True, on_start=handles.append)
    assert result.exit_code == 0 and handles[0].process_id == "p1"
    assert api.exec_bodies[-1]["open_stdin"] is True


_CHANGES = [
    WatchEvent("create", "/home/user/d/a", "a", False),
    WatchEvent("dropped", count=7),
    WatchEvent("rename", "/home/user/d/sub", "sub", True),
]


async def test_remote_node_streams_watch_events_and_closing_releases_the_watch() -> None:
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        node.boxes["sb-1"].dirs.add("/home/user/d")
        node.boxes["sb-1"].files["/home/user/f"] = b""
        node.watch_events["sb-1"] = _CHANGES
        stream = await client.watch_dir("sb-1", "/home/user/d", recursive=True)
        events = [event async for event in stream]
        await stream.aclose()
        with pytest.raises(NotFound):
            await client.watch_dir("sb-1", "/home/user/missing")
        with pytest.raises(InvalidArgument):
            await client.watch_dir("sb-1", "/home/user/f")
    assert (stream.path, events) == ("/home/user/d", _CHANGES)
    assert node.watch_streams[0][2] is True and node.watch_streams[0][3].closed


async def test_rest_watch_answers_ndjson_and_the_sdk_iterates_it(api: LiveApi) -> None:
    async with await _create(api) as sandbox:
        api.node.boxes[sandbox.sandbox_id].dirs.add("/home/user/d")
        api.node.watch_events[sandbox.sandbox_id] = _CHANGES
        async with await sandbox.files.watch_dir("/home/user/d", recursive=True) as watcher:
            events = [event async for event in watcher]
        with pytest.raises(SdkNotFound):
            await sandbox.files.watch_dir("/home/user/missing")
    assert watcher.path == "/home/user/d"
    assert [(e.type, e.name, e.is_dir, e.count) for e in events] == [
        ("create", "a", False, 0),
        ("dropped", "", False, 7),
        ("rename", "sub", True, 0),
    ]
    assert api.node.watch_streams[0][3].closed  # released when the stream ended
