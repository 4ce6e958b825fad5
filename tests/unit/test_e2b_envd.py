"""envd's routes (port 49983 of a sandbox) as the control plane translates them, spoken
in raw Connect and HTTP over httpx to the control plane over a fake node."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.control.access_tokens import TokenPurpose, sandbox_token
from space.control.e2b.connect import ConnectError, envelope
from space.control.e2b.envd_filesystem import (
    MAX_BUFFERED_EVENTS,
    MAX_WATCHERS_PER_SANDBOX,
    WATCHER_IDLE_S,
    Watchers,
)
from space.control.sandbox_traffic import ENVD_PORT, UNAUTHORIZED_MESSAGE
from space.control.store import repo
from space.node.api import ExecExited, ExecOutput, SandboxState, WatchEvent
from tests.unit._fake_stdio import FakeWatchStream
from tests.unit.fakes import Harness, control_app

pytestmark = pytest.mark.anyio

BASH = "/bin/bash -l -c"


class Envd:
    """A raw client of one sandbox's envd, through the control plane."""

    def __init__(self, h: Harness, sandbox_id: str, token: str | None = None) -> None:
        self.h = h
        self.sandbox_id = sandbox_id
        ctx = h.app.state.ctx
        self.token = token or sandbox_token(ctx.node_token, sandbox_id, TokenPurpose.ENVD)

    def headers(self, **extra: str) -> dict[str, str]:
        return {
            "E2b-Sandbox-Id": self.sandbox_id,
            "E2b-Sandbox-Port": str(ENVD_PORT),
            "X-Access-Token": self.token,
            **extra,
        }

    async def unary(self, method: str, body: dict[str, Any]) -> httpx.Response:
        return await self.h.client.post(
            f"/{method}", json=body, headers=self.headers(**{"Content-Type": "application/json"})
        )

    async def stream(self, method: str, body: dict[str, Any], **extra: str) -> list[Any]:
        """Every envelope's (flags, message) of a server stream."""
        headers = self.headers(**{"Content-Type": "application/connect+json", **extra})
        answer = await self.h.client.post(f"/{method}", content=envelope(body), headers=headers)
        assert answer.status_code == 200
        assert answer.headers["content-type"] == "application/connect+json"
        return _envelopes(answer.content)


def _envelopes(data: bytes) -> list[tuple[int, Any]]:
    out = []
    while data:
        flags, length = struct.unpack(">BI", data[:5])
        out.append((flags, json.loads(data[5 : 5 + length])))
        data = data[5 + length :]
    return out


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@contextlib.asynccontextmanager
async def _envd(tmp_path: Path) -> AsyncIterator[Envd]:
    async with control_app(tmp_path) as h:
        answer = await h.client.post("/v1/sandboxes", json={}, headers=h.key("acme"))
        yield Envd(h, answer.json()["id"])


async def test_negative_a_wrong_or_missing_token_or_unknown_sandbox_is_refused_alike(
    tmp_path: Path,
) -> None:
    async with _envd(tmp_path) as envd:
        other = sandbox_token(envd.h.app.state.ctx.node_token, "sbx-other", TokenPurpose.ENVD)
        traffic = sandbox_token(
            envd.h.app.state.ctx.node_token, envd.sandbox_id, TokenPurpose.TRAFFIC
        )
        for client in (
            Envd(envd.h, envd.sandbox_id, token=other),
            Envd(envd.h, envd.sandbox_id, token=traffic),
            Envd(envd.h, "sbx-unknown", token=other),
        ):
            answer = await client.unary("process.Process/List", {})
            assert answer.status_code == 401
            assert answer.json() == {"code": 401, "message": UNAUTHORIZED_MESSAGE}
        headers = envd.headers()
        del headers["X-Access-Token"]
        answer = await envd.h.client.get("/health", headers=headers)
        assert answer.status_code == 401
        assert ("list_processes", envd.sandbox_id) not in envd.h.node.calls


async def test_health_answers_204_and_an_unknown_route_404(tmp_path: Path) -> None:
    async with _envd(tmp_path) as envd:
        assert (await envd.h.client.get("/health", headers=envd.headers())).status_code == 204
        answer = await envd.h.client.get("/nope", headers=envd.headers())
        assert answer.status_code == 404 and answer.json()["code"] == 404


async def test_start_streams_start_data_and_end_of_a_background_process_in_one_exec(
    tmp_path: Path,
) -> None:
    async with _envd(tmp_path) as envd:
        envd.h.node.scripts[f"{BASH} echo hi"] = [
            ExecOutput("stdout", b"hi\n"),
            ExecOutput("stderr", b"\xffoops"),
            ExecExited(3, None),
        ]
        request = {
            "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {"A": "1"}},
            "stdin": True,
            "tag": "job-1",
        }
        user = {"Authorization": "Basic " + _b64(b"root:")}
        events = await envd.stream("process.Process/Start", request, **user)
        assert events == [
            (0, {"event": {"start": {"pid": 100}}}),
            (0, {"event": {"data": {"stdout": _b64(b"hi\n")}}}),
            (0, {"event": {"data": {"stderr": _b64(b"\xffoops")}}}),
            (0, {"event": {"end": {"exitCode": 3, "exited": True, "status": "exit status 3"}}}),
            (2, {}),
        ]
        # One guest request: a background exec that follows its output, no attach.
        assert [c[0] for c in envd.h.node.calls if c[0] in ("exec", "attach")] == ["exec"]
        (started,) = envd.h.node.exec_requests
        assert started.background and started.follow and started.tag == "job-1"
        assert (envd.sandbox_id, "p1") in envd.h.node.stdin  # open_stdin


async def test_a_process_ended_by_a_signal_ends_as_go_says_and_a_timeout_as_deadline(
    tmp_path: Path,
) -> None:
    async with _envd(tmp_path) as envd:
        envd.h.node.scripts[f"{BASH} sleep 9"] = [ExecExited(None, 9)]
        envd.h.node.scripts[f"{BASH} slow"] = [ExecExited(None, 9, timed_out=True)]
        start = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "sleep 9"]}}
        events = await envd.stream("process.Process/Start", start)
        end = {"exitCode": -1, "exited": False, "status": "signal: killed"}
        assert events[-2:] == [(0, {"event": {"end": end}}), (2, {})]
        start = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "slow"]}}
        events = await envd.stream("process.Process/Start", start, **{"Connect-Timeout-Ms": "5"})
        assert events[-1][0] == 2
        assert events[-1][1]["error"]["code"] == "deadline_exceeded"


async def test_negative_a_start_the_node_refuses_ends_the_stream_with_its_code(
    tmp_path: Path,
) -> None:
    async with _envd(tmp_path) as envd:
        start = {"process": {"cmd": "/bin/ls", "cwd": "/nowhere"}}
        events = await envd.stream("process.Process/Start", start)
        assert events == [(2, {"error": {"code": "not_found", "message": "no directory /nowhere"}})]
        events = await envd.stream("process.Process/Start", {"process": {"cmd": ""}})
        assert events[0][1]["error"]["code"] == "invalid_argument"


async def test_list_signal_input_close_and_resize_find_processes_by_pid_or_tag(
    tmp_path: Path,
) -> None:
    async with _envd(tmp_path) as envd:
        pty = {"size": {"rows": 24, "cols": 80}}
        start = {"process": {"cmd": "/bin/bash", "args": ["-i"]}, "pty": pty, "tag": "term"}
        await envd.stream("process.Process/Start", start)
        listed = (await envd.unary("process.Process/List", {})).json()
        config = {"cmd": "/bin/bash", "args": ["-i"], "envs": {}}
        assert listed == {"processes": [{"config": config, "pid": 100, "tag": "term"}]}

        by_pid, by_tag = {"pid": 100}, {"tag": "term"}
        data = {"process": by_tag, "input": {"pty": _b64(b"ls\n")}}
        assert (await envd.unary("process.Process/SendInput", data)).json() == {}
        update = {"process": by_pid, "pty": {"size": {"rows": 50, "cols": 120}}}
        assert (await envd.unary("process.Process/Update", update)).status_code == 200
        assert envd.h.node.stdin[(envd.sandbox_id, "p1")] == b"ls\n"
        assert envd.h.node.pty_sizes[(envd.sandbox_id, "p1")].cols == 120
        assert (await envd.unary("process.Process/CloseStdin", {"process": by_pid})).json() == {}
        assert (envd.sandbox_id, "p1") in envd.h.node.stdin_closed

        signal = {"process": by_pid, "signal": "SIGNAL_SIGKILL"}
        assert (await envd.unary("process.Process/SendSignal", signal)).status_code == 200
        assert (await envd.unary("process.Process/List", {})).json() == {"processes": []}
        # An ended process is found no more: the SDK's kill() answers False on not_found.
        answer = await envd.unary("process.Process/SendSignal", signal)
        assert answer.status_code == 404 and answer.json()["code"] == "not_found"


async def test_connect_attaches_by_pid_or_tag_in_one_node_call(tmp_path: Path) -> None:
    async with _envd(tmp_path) as envd:
        envd.h.node.scripts[f"{BASH} top"] = [ExecOutput("stdout", b"\x1b[H"), ExecExited(0, None)]
        pty = {"size": {"rows": 24, "cols": 80}}
        start = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "top"]}, "pty": pty}
        await envd.stream("process.Process/Start", start | {"tag": "term"})
        expected = [
            (0, {"event": {"start": {"pid": 100}}}),
            (0, {"event": {"data": {"pty": _b64(b"\x1b[H")}}}),  # a terminal's output
            (0, {"event": {"end": {"exitCode": 0, "exited": True, "status": "exit status 0"}}}),
            (2, {}),
        ]
        for selector in ({"pid": 100}, {"tag": "term"}):
            envd.h.node.calls.clear()
            assert await envd.stream("process.Process/Connect", {"process": selector}) == expected
            # The guest finds the process: no listing first (issue 20).
            assert [c[0] for c in envd.h.node.calls] == ["attach"]


async def test_negative_connect_to_no_running_process_is_not_found_and_no_selector_invalid(
    tmp_path: Path,
) -> None:
    async with _envd(tmp_path) as envd:
        # Out of range or of pattern: no process can have it, as envd says.
        nobody = ({"pid": 4242}, {"pid": 0}, {"pid": 2**32 - 1}, {"tag": "none"}, {"tag": "a b"})
        for selector in nobody:
            events = await envd.stream("process.Process/Connect", {"process": selector})
            assert [e[1]["error"]["code"] for e in events] == ["not_found"], selector
        events = await envd.stream("process.Process/Connect", {"process": {}})
        assert [e[1]["error"]["code"] for e in events] == ["invalid_argument"]


async def test_stream_input_writes_each_chunk_after_its_start(tmp_path: Path) -> None:
    async with _envd(tmp_path) as envd:
        start = {"process": {"cmd": "/bin/cat"}, "stdin": True}
        await envd.stream("process.Process/Start", start)
        body = (
            envelope({"start": {"process": {"pid": 100}}})
            + envelope({"keepalive": {}})
            + envelope({"data": {"input": {"stdin": _b64(b"one ")}}})
            + envelope({"data": {"input": {"stdin": _b64(b"two")}}})
        )
        headers = envd.headers(**{"Content-Type": "application/connect+json"})
        answer = await envd.h.client.post(
            "/process.Process/StreamInput", content=body, headers=headers
        )
        assert _envelopes(answer.content) == [(0, {}), (2, {})]
        assert envd.h.node.stdin[(envd.sandbox_id, "p1")] == b"one two"
        early = envelope({"data": {"input": {"stdin": _b64(b"x")}}})
        answer = await envd.h.client.post(
            "/process.Process/StreamInput", content=early, headers=headers
        )
        assert _envelopes(answer.content)[-1][1]["error"]["code"] == "invalid_argument"


async def test_negative_malformed_rpcs_get_connect_errors(tmp_path: Path) -> None:
    async with _envd(tmp_path) as envd:
        answer = await envd.h.client.post(
            "/process.Process/List",
            content=b"{not json",
            headers=envd.headers(**{"Content-Type": "application/json"}),
        )
        assert answer.status_code == 400 and answer.json()["code"] == "invalid_argument"
        answer = await envd.h.client.post(
            "/process.Process/List",
            content=b"\x00",
            headers=envd.headers(**{"Content-Type": "application/proto"}),
        )
        assert answer.status_code == 501 and answer.json()["code"] == "unimplemented"
        signal = {"process": {"pid": 1}, "signal": "SIGNAL_SIGSTOP"}
        answer = await envd.unary("process.Process/SendSignal", signal)
        assert answer.json()["code"] == "invalid_argument"
        answer = await envd.unary("process.Process/SendInput", {"process": {}})
        assert answer.json()["code"] == "invalid_argument"
        headers = envd.headers(**{"Content-Type": "application/connect+json"})
        oversized = struct.pack(">BI", 0, 64 * 1024 * 1024)
        answer = await envd.h.client.post(
            "/process.Process/Start", content=oversized, headers=headers
        )
        assert _envelopes(answer.content)[0][1]["error"]["code"] == "resource_exhausted"


async def test_filesystem_stat_list_mkdir_move_remove(tmp_path: Path) -> None:
    async with _envd(tmp_path) as envd:
        box = envd.h.node.boxes[envd.sandbox_id]
        box.dirs |= {"/home", "/home/user", "/home/user/d"}
        box.files["/home/user/a.txt"] = b"12345"
        box.files["/home/user/d/b.txt"] = b"x"

        entry = (
            await envd.unary("filesystem.Filesystem/Stat", {"path": "/home/user/a.txt"})
        ).json()
        assert entry["entry"] | {"modifiedTime": None} == {
            "name": "a.txt",
            "type": "FILE_TYPE_FILE",
            "path": "/home/user/a.txt",
            "size": "5",
            "mode": 0o644,
            "permissions": "-rw-r--r--",
            "owner": "user",
            "group": "user",
            "modifiedTime": None,
            "isSymlink": False,
        }
        missing = await envd.unary("filesystem.Filesystem/Stat", {"path": "/nope"})
        assert missing.status_code == 404 and missing.json()["code"] == "not_found"

        one = await envd.unary("filesystem.Filesystem/ListDir", {"path": "/home/user", "depth": 1})
        assert [e["name"] for e in one.json()["entries"]] == ["a.txt", "d"]
        two = await envd.unary("filesystem.Filesystem/ListDir", {"path": "/home/user", "depth": 2})
        assert [e["path"] for e in two.json()["entries"]] == [
            "/home/user/a.txt",
            "/home/user/d",
            "/home/user/d/b.txt",
        ]

        made = await envd.unary("filesystem.Filesystem/MakeDir", {"path": "/home/user/new"})
        assert made.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
        again = await envd.unary("filesystem.Filesystem/MakeDir", {"path": "/home/user/new"})
        assert again.status_code == 409 and again.json()["code"] == "already_exists"

        move = {"source": "/home/user/a.txt", "destination": "/home/user/c.txt"}
        moved = await envd.unary("filesystem.Filesystem/Move", move)
        assert moved.json()["entry"]["path"] == "/home/user/c.txt"
        removed = await envd.unary("filesystem.Filesystem/Remove", {"path": "/home/user/c.txt"})
        assert removed.json() == {} and "/home/user/c.txt" not in box.files


async def test_watch_dir_streams_changes_and_watchers_keep_them_for_polls(
    tmp_path: Path,
) -> None:
    async with _envd(tmp_path) as envd:
        envd.h.node.watch_events[envd.sandbox_id] = [
            WatchEvent("create", "/w/f", "f"),
            WatchEvent("dropped", count=3),
            WatchEvent("write", "/w/f", "f"),
        ]
        envd.h.node.boxes[envd.sandbox_id].dirs.add("/w")
        events = await envd.stream(
            "filesystem.Filesystem/WatchDir", {"path": "/w", "recursive": True}
        )
        assert events == [
            (0, {"start": {}}),
            (0, {"filesystem": {"name": "f", "type": "EVENT_TYPE_CREATE"}}),
            (0, {"filesystem": {"name": "f", "type": "EVENT_TYPE_WRITE"}}),
            (2, {}),
        ]
        assert envd.h.node.watch_streams[0][2] is True

        created = await envd.unary("filesystem.Filesystem/CreateWatcher", {"path": "/w"})
        watcher_id = created.json()["watcherId"]
        polled = await envd.unary(
            "filesystem.Filesystem/GetWatcherEvents", {"watcherId": watcher_id}
        )
        assert [e["type"] for e in polled.json()["events"]] == [
            "EVENT_TYPE_CREATE",
            "EVENT_TYPE_WRITE",
        ]
        # The fake's watch has ended (its directory gone): the next poll says so.
        ended = await envd.unary(
            "filesystem.Filesystem/GetWatcherEvents", {"watcherId": watcher_id}
        )
        assert ended.json()["code"] == "not_found"


async def test_negative_watchers_are_bounded_per_sandbox_and_scoped_to_it(tmp_path: Path) -> None:
    async with _envd(tmp_path) as envd:
        envd.h.node.boxes[envd.sandbox_id].dirs.add("/w")
        many = [WatchEvent("write", "/w/f", "f")] * (MAX_BUFFERED_EVENTS + 5)
        envd.h.node.watch_events[envd.sandbox_id] = many
        ids = []
        for _ in range(MAX_WATCHERS_PER_SANDBOX):
            created = await envd.unary("filesystem.Filesystem/CreateWatcher", {"path": "/w"})
            ids.append(created.json()["watcherId"])
        over = await envd.unary("filesystem.Filesystem/CreateWatcher", {"path": "/w"})
        assert over.status_code == 429 and over.json()["code"] == "resource_exhausted"
        polled = await envd.unary("filesystem.Filesystem/GetWatcherEvents", {"watcherId": ids[0]})
        assert len(polled.json()["events"]) == MAX_BUFFERED_EVENTS

        other_id = (
            await envd.h.client.post("/v1/sandboxes", json={}, headers=envd.h.key("acme"))
        ).json()["id"]
        other = Envd(envd.h, other_id)
        stolen = await other.unary("filesystem.Filesystem/GetWatcherEvents", {"watcherId": ids[1]})
        assert stolen.json()["code"] == "not_found"
        removed = await envd.unary("filesystem.Filesystem/RemoveWatcher", {"watcherId": ids[1]})
        assert removed.json() == {}
        again = await envd.unary("filesystem.Filesystem/CreateWatcher", {"path": "/w"})
        assert again.status_code == 200


async def test_files_upload_octet_stream_and_multipart_then_download(tmp_path: Path) -> None:
    async with _envd(tmp_path) as envd:
        box = envd.h.node.boxes[envd.sandbox_id]
        data = bytes(range(256)) * 1000
        answer = await envd.h.client.post(
            "/files",
            params={"path": "/home/user/raw.bin", "username": "user"},
            content=data,
            headers=envd.headers(**{"Content-Type": "application/octet-stream"}),
        )
        assert answer.json() == [{"name": "raw.bin", "type": "file", "path": "/home/user/raw.bin"}]
        assert box.files["/home/user/raw.bin"] == data

        files = [("file", ("/tmp/a.txt", b"alpha")), ("file", ("/tmp/b.txt", b"\r\n--beta"))]
        answer = await envd.h.client.post("/files", files=files, headers=envd.headers())
        assert [w["path"] for w in answer.json()] == ["/tmp/a.txt", "/tmp/b.txt"]
        assert box.files["/tmp/b.txt"] == b"\r\n--beta"

        got = await envd.h.client.get(
            "/files", params={"path": "/home/user/raw.bin"}, headers=envd.headers()
        )
        assert got.status_code == 200 and got.content == data
        missing = await envd.h.client.get("/files", params={"path": "/no"}, headers=envd.headers())
        assert missing.status_code == 404 and missing.json()["code"] == 404
        denied = await envd.h.client.post(
            "/files", params={"path": "/readonly/x"}, content=b"x", headers=envd.headers()
        )
        assert denied.status_code == 403
        bad_user = await envd.h.client.get(
            "/files", params={"path": "/x", "username": "../root"}, headers=envd.headers()
        )
        assert bad_user.status_code == 400


async def test_a_paused_sandbox_is_resumed_before_its_operation(tmp_path: Path) -> None:
    async with _envd(tmp_path) as envd:
        paused = await envd.h.client.post(
            f"/v1/sandboxes/{envd.sandbox_id}/pause", headers=envd.h.key("acme")
        )
        assert paused.json()["state"] == "paused"
        assert (await envd.unary("process.Process/List", {})).status_code == 200
        assert envd.h.node.boxes[envd.sandbox_id].status.state == SandboxState.RUNNING
        got = await envd.h.client.get(
            f"/v1/sandboxes/{envd.sandbox_id}", headers=envd.h.key("acme")
        )
        assert got.json()["state"] == "running"


async def test_negative_a_sandbox_that_is_not_running_is_not_found_as_the_sdk_reads_it(
    tmp_path: Path,
) -> None:
    async with _envd(tmp_path) as envd:
        ctx = envd.h.app.state.ctx
        await ctx.db.run(lambda s: repo.set_state(s, envd.sandbox_id, "stopped", error=None))
        health = await envd.h.client.get("/health", headers=envd.headers())
        assert health.status_code == 502 and "was not found" in health.json()["message"]
        listed = await envd.unary("process.Process/List", {})
        assert listed.status_code == 503 and listed.json()["code"] == "unavailable"
        assert "was not found" in listed.json()["message"]
        events = await envd.stream("process.Process/Start", {"process": {"cmd": "/bin/true"}})
        assert events[0][1]["error"]["code"] == "unavailable"
        assert ("exec", envd.sandbox_id) not in envd.h.node.calls


async def test_envd_is_reached_by_its_host_name_under_the_sandbox_domain(tmp_path: Path) -> None:
    async with _envd(tmp_path) as envd:
        ctx = envd.h.app.state.ctx
        ctx.settings = dataclasses.replace(ctx.settings, sandbox_domain="sbx.example.com")
        host = f"{ENVD_PORT}-{envd.sandbox_id}.sbx.example.com"
        headers = {"Host": host, "X-Access-Token": envd.token, "Content-Type": "application/json"}
        answer = await envd.h.client.post("/process.Process/List", json={}, headers=headers)
        assert answer.status_code == 200 and answer.json() == {"processes": []}


async def test_a_deleted_sandbox_is_gone_to_its_token_holder_and_unknown_to_others(
    tmp_path: Path,
) -> None:
    async with _envd(tmp_path) as envd:
        url = f"/v1/sandboxes/{envd.sandbox_id}"
        assert (await envd.h.client.delete(url, headers=envd.h.key("acme"))).status_code == 204
        health = await envd.h.client.get("/health", headers=envd.headers())
        assert health.status_code == 502
        assert health.json()["message"] == f"sandbox {envd.sandbox_id} was not found"
        listed = await envd.unary("process.Process/List", {})
        assert listed.status_code == 502  # the SDK: SandboxNotRunningException
        wrong = Envd(envd.h, envd.sandbox_id, token="wrong")
        answer = await wrong.unary("process.Process/List", {})
        assert answer.status_code == 401
        assert answer.json() == {"code": 401, "message": UNAUTHORIZED_MESSAGE}


async def test_negative_a_watcher_nobody_polls_expires_and_releases_its_watch() -> None:
    now = [0.0]
    watchers = Watchers(clock=lambda: now[0])
    stream = FakeWatchStream("/w", [])
    tasks: list[asyncio.Task[None]] = []

    def spawn(coroutine: Any) -> asyncio.Task[None]:
        tasks.append(asyncio.get_running_loop().create_task(coroutine))
        return tasks[-1]

    async def open_watch() -> FakeWatchStream:
        return stream

    watcher_id = await watchers.create("sbx-1", open_watch, spawn)
    now[0] = WATCHER_IDLE_S  # exactly the idle limit: kept
    await watchers.expire()
    assert watchers.count("sbx-1") == 1
    now[0] = WATCHER_IDLE_S + 0.01
    await watchers.expire()
    assert watchers.count("sbx-1") == 0 and stream.closed
    with pytest.raises(ConnectError):
        await watchers.events("sbx-1", watcher_id)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
