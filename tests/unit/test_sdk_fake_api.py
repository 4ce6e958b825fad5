"""A fake SPACE API, built only from docs/api.md, for testing the SDK and CLI without VMs.

Commands do not run: a test scripts what an exec answers (``FakeApi.scripts``), keyed by
the shell string or the argv joined with spaces. The tests at the bottom pin the fake
itself to the contract, so the SDK tests do not test the SDK against a wrong fake.
"""

from __future__ import annotations

import base64
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from space.sdk import AsyncSandbox, Sandbox, SandboxInfo
from space.sdk.errors import Conflict, NotFound

API_KEY = "sk-test-key"

#: One scripted event: ("stdout" | "stderr", bytes), or ("exit", exit_code, signal,
#: timed_out), or ("error", code, message).
Event = tuple[Any, ...]


@dataclass
class FakeProcess:
    process_id: str
    pid: int
    body: dict[str, Any]
    events: list[Event]
    killed_with: int | None = None


@dataclass
class FakeApi:
    sandboxes: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: dict[tuple[str, str], bytes] = field(default_factory=dict)
    scripts: dict[str, list[Event]] = field(default_factory=dict)
    processes: dict[str, FakeProcess] = field(default_factory=dict)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    exec_bodies: list[dict[str, Any]] = field(default_factory=list)
    upload_chunks: list[int] = field(default_factory=list)
    #: (status, code, message) answered to the next request instead of the real answer.
    fail_next: tuple[int, str, str] | None = None
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def transport(self) -> httpx.ASGITransport:
        return httpx.ASGITransport(app=self.app())

    def app(self) -> Callable[[Any, Any, Any], Awaitable[None]]:
        base = "/v1/sandboxes"
        routes = [
            Route(base, self._create, methods=["POST"]),
            Route(base, self._list, methods=["GET"]),
            Route(base + "/{sid}", self._get, methods=["GET"]),
            Route(base + "/{sid}", self._delete, methods=["DELETE"]),
            Route(base + "/{sid}/pause", self._pause, methods=["POST"]),
            Route(base + "/{sid}/resume", self._resume, methods=["POST"]),
            Route(base + "/{sid}/exec", self._exec, methods=["POST"]),
            Route(base + "/{sid}/processes", self._processes, methods=["GET"]),
            Route(base + "/{sid}/processes/{pid}/stream", self._stream, methods=["GET"]),
            Route(base + "/{sid}/processes/{pid}/kill", self._kill, methods=["POST"]),
            Route(base + "/{sid}/files", self._write, methods=["PUT"]),
            Route(base + "/{sid}/files", self._read, methods=["GET"]),
            Route(base + "/{sid}/files", self._remove, methods=["DELETE"]),
            Route(base + "/{sid}/files/stat", self._stat, methods=["GET"]),
            Route(base + "/{sid}/files/list", self._listdir, methods=["GET"]),
            Route(base + "/{sid}/files/mkdir", self._mkdir, methods=["POST"]),
            Route(base + "/{sid}/files/rename", self._rename, methods=["POST"]),
        ]
        app = Starlette(routes=routes)

        async def guarded(scope: Any, receive: Any, send: Any) -> None:
            request = Request(scope)
            self.requests.append((request.method, request.url.path, dict(request.headers)))
            denial = self._precheck(request)
            if denial is not None:
                await denial(scope, receive, send)
            else:
                await app(scope, receive, send)

        return guarded

    # plumbing

    def _precheck(self, request: Request) -> Response | None:
        if self.fail_next is not None:
            status, code, message = self.fail_next
            self.fail_next = None
            return _error(status, code, message)
        auth = request.headers.get("authorization", "")
        if auth != f"Bearer {API_KEY}" and request.headers.get("x-api-key") != API_KEY:
            return _error(401, "unauthenticated", "missing or unknown API key")
        return None

    def _sandbox(self, request: Request) -> dict[str, Any] | None:
        return self.sandboxes.get(request.path_params["sid"])

    # sandboxes

    async def _create(self, request: Request) -> Response:
        body = await request.json()
        if not 1 <= body.get("cpus", 1) <= 8:
            return _error(422, "invalid_argument", "cpus must be 1-8")
        sid = f"sbx{next(self._ids):04d}"
        self.sandboxes[sid] = {
            "id": sid,
            "template": body.get("template", "base"),
            "state": "running",
            "cpus": body.get("cpus", 1),
            "memory_mib": body.get("memory_mib", 256),
            "disk_mib": body.get("disk_mib", 2048),
            "env": body.get("env", {}),
            "metadata": body.get("metadata", {}),
            "created_at": "2026-11-30T12:00:00Z",
            "expires_at": "2026-11-30T12:05:00Z",
            "node_id": "local",
        }
        return JSONResponse(self.sandboxes[sid], status_code=201)

    async def _list(self, request: Request) -> Response:
        return JSONResponse({"sandboxes": list(self.sandboxes.values())})

    async def _get(self, request: Request) -> Response:
        sandbox = self._sandbox(request)
        return JSONResponse(sandbox) if sandbox else _missing()

    async def _delete(self, request: Request) -> Response:
        if self.sandboxes.pop(request.path_params["sid"], None) is None:
            return _missing()
        return Response(status_code=204)

    async def _pause(self, request: Request) -> Response:
        return self._transition(request, "pause", "paused")

    async def _resume(self, request: Request) -> Response:
        return self._transition(request, "resume", "running")

    def _transition(self, request: Request, action: str, state: str) -> Response:
        """running <-> paused, idempotent; any other state is 409 naming it."""
        sandbox = self._sandbox(request)
        if sandbox is None:
            return _missing()
        if sandbox.get("state") not in ("running", "paused"):
            message = f"cannot {action} sandbox {sandbox['id']}: it is {sandbox.get('state')}"
            return _error(409, "conflict", message, {"state": sandbox.get("state")})
        sandbox["state"] = state
        return JSONResponse(sandbox)

    # commands

    async def _exec(self, request: Request) -> Response:
        sandbox = self._sandbox(request)
        if sandbox is None:
            return _missing()
        if sandbox.get("state") == "paused":
            sandbox["state"] = "running"  # guest operations resume a paused sandbox
        body = await request.json()
        self.exec_bodies.append(body)
        key = body["cmd"] if "cmd" in body else " ".join(body["argv"])
        events = self.scripts.get(key, [("stderr", b"not found\n"), ("exit", 127, None, False)])
        process = FakeProcess(f"p{next(self._ids)}", 100 + len(self.processes), body, events)
        self.processes[process.process_id] = process
        start = {"type": "start", "pid": process.pid, "process_id": process.process_id}
        lines = [start] if body.get("background") else [start, *_wire(process.events)]
        return _ndjson(lines)

    async def _processes(self, request: Request) -> Response:
        listing = [
            {
                "process_id": p.process_id,
                "pid": p.pid,
                "argv": p.body.get("argv"),
                "cmd": p.body.get("cmd"),
                "running": p.killed_with is None,
                "exit_code": None,
                "signal": p.killed_with,
                "started_at": 0.0,
            }
            for p in self.processes.values()
        ]
        return JSONResponse({"processes": listing})

    async def _stream(self, request: Request) -> Response:
        process = self.processes.get(request.path_params["pid"])
        if process is None:
            return _missing()
        start = {"type": "start", "pid": process.pid, "process_id": process.process_id}
        events = process.events
        if process.killed_with is not None:
            events = [e for e in events if e[0] != "exit"] + [
                ("exit", None, process.killed_with, False)
            ]
        return _ndjson([start, *_wire(events)])

    async def _kill(self, request: Request) -> Response:
        process = self.processes.get(request.path_params["pid"])
        if process is None:
            return _missing()
        process.killed_with = (await request.json()).get("signal", 9)
        return Response(status_code=204)

    # files

    async def _write(self, request: Request) -> Response:
        if self._sandbox(request) is None:
            return _missing()
        path = request.query_params["path"]
        data = bytearray()
        async for chunk in request.stream():
            if chunk:
                self.upload_chunks.append(len(chunk))
            data += chunk
        self.files[(request.path_params["sid"], path)] = bytes(data)
        return JSONResponse(_stat(path, len(data)))

    async def _read(self, request: Request) -> Response:
        data = self.files.get((request.path_params["sid"], request.query_params["path"]))
        if data is None:
            return _missing()
        return Response(data, headers={"Content-Length": str(len(data))})

    async def _remove(self, request: Request) -> Response:
        key = (request.path_params["sid"], request.query_params["path"])
        if self.files.pop(key, None) is None:
            return _missing()
        return Response(status_code=204)

    async def _stat(self, request: Request) -> Response:
        path = request.query_params["path"]
        data = self.files.get((request.path_params["sid"], path))
        return _missing() if data is None else JSONResponse(_stat(path, len(data)))

    async def _listdir(self, request: Request) -> Response:
        prefix = request.query_params["path"].rstrip("/") + "/"
        entries = [
            _stat(path, len(data))
            for (sid, path), data in self.files.items()
            if sid == request.path_params["sid"] and path.startswith(prefix)
        ]
        return JSONResponse({"entries": entries})

    async def _mkdir(self, request: Request) -> Response:
        path = (await request.json())["path"]
        return JSONResponse({**_stat(path, 0), "type": "dir", "mode": 0o755})

    async def _rename(self, request: Request) -> Response:
        body = await request.json()
        sid = request.path_params["sid"]
        data = self.files.pop((sid, body["src"]), None)
        if data is None:
            return _missing()
        self.files[(sid, body["dst"])] = data
        return JSONResponse(_stat(body["dst"], len(data)))


def _error(status: int, code: str, message: str, details: dict[str, Any] | None = None) -> Response:
    body = {"error": {"code": code, "message": message, "details": details or {}}}
    return JSONResponse(body, status)


def _missing() -> Response:
    return _error(404, "not_found", "no such thing")


def _stat(path: str, size: int) -> dict[str, Any]:
    name = path.rsplit("/", 1)[-1]
    return {
        "name": name,
        "path": path,
        "type": "file",
        "size": size,
        "mode": 0o644,
        "mtime": 0.0,
        "owner": "user",
    }


def _wire(events: list[Event]) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for event in events:
        if event[0] in ("stdout", "stderr"):
            lines.append({"type": event[0], "data": base64.b64encode(event[1]).decode()})
        elif event[0] == "exit":
            _, code, sig, timed_out = event
            lines.append({"type": "exit", "exit_code": code, "signal": sig, "timed_out": timed_out})
        else:
            lines.append({"type": "error", "code": event[1], "message": event[2]})
    return lines


def _ndjson(lines: list[dict[str, Any]]) -> Response:
    async def body() -> AsyncIterator[bytes]:
        for line in lines:
            yield json.dumps(line).encode() + b"\n"

    return StreamingResponse(body(), media_type="application/x-ndjson")


# The fake itself follows the contract.

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def fake() -> FakeApi:
    return FakeApi()


async def _client(fake: FakeApi) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=fake.transport(),
        base_url="http://space",
        headers={"Authorization": f"Bearer {API_KEY}"},
    )


async def test_fake_api_creates_sandbox_with_201_and_the_documented_fields(fake: FakeApi) -> None:
    async with await _client(fake) as client:
        answer = await client.post("/v1/sandboxes", json={"template": "base"})
    assert answer.status_code == 201
    assert set(answer.json()) == {
        "id", "template", "state", "cpus", "memory_mib", "disk_mib",
        "env", "metadata", "created_at", "expires_at", "node_id",
    }  # fmt: skip


async def test_negative_fake_api_answers_401_in_the_error_shape_without_a_key(
    fake: FakeApi,
) -> None:
    async with httpx.AsyncClient(transport=fake.transport(), base_url="http://x") as client:
        answer = await client.get("/v1/sandboxes")
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "unauthenticated"


async def test_fake_api_exec_streams_start_output_exit_as_ndjson(fake: FakeApi) -> None:
    fake.sandboxes["s1"] = {"id": "s1"}
    fake.scripts["echo hi"] = [("stdout", b"hi\n"), ("exit", 0, None, False)]
    async with await _client(fake) as client:
        answer = await client.post("/v1/sandboxes/s1/exec", json={"cmd": "echo hi"})
    events = [json.loads(line) for line in answer.text.splitlines()]
    assert answer.headers["content-type"] == "application/x-ndjson"
    assert [e["type"] for e in events] == ["start", "stdout", "exit"]
    assert base64.b64decode(events[1]["data"]) == b"hi\n"


async def test_fake_api_pause_and_resume_answer_the_sandbox_in_its_new_state(
    fake: FakeApi,
) -> None:
    async with await _client(fake) as client:
        sid = (await client.post("/v1/sandboxes", json={})).json()["id"]
        paused = await client.post(f"/v1/sandboxes/{sid}/pause")
        again = await client.post(f"/v1/sandboxes/{sid}/pause")
        resumed = await client.post(f"/v1/sandboxes/{sid}/resume")
    assert (paused.status_code, paused.json()["state"]) == (200, "paused")
    assert (again.status_code, again.json()["state"]) == (200, "paused")
    assert (resumed.status_code, resumed.json()["state"]) == (200, "running")


async def test_negative_fake_api_pause_of_a_sandbox_in_error_is_409_naming_the_state(
    fake: FakeApi,
) -> None:
    fake.sandboxes["s1"] = {"id": "s1", "state": "error"}
    async with await _client(fake) as client:
        answer = await client.post("/v1/sandboxes/s1/pause")
    assert answer.status_code == 409
    assert answer.json()["error"]["details"] == {"state": "error"}
    assert fake.sandboxes["s1"]["state"] == "error"


# The SDK's pause and resume against the fake.


async def _sdk_sandbox(fake: FakeApi) -> AsyncSandbox:
    return await AsyncSandbox.create(
        api_url="http://space", api_key=API_KEY, _transport=fake.transport()
    )


async def test_sdk_pause_and_resume_post_to_the_documented_paths_and_report_the_state(
    fake: FakeApi,
) -> None:
    sandbox = await _sdk_sandbox(fake)
    sid = sandbox.sandbox_id

    paused = await sandbox.pause()
    listed = {info.sandbox_id: info.state for info in await _list(fake)}
    resumed = await sandbox.resume()
    await sandbox.close()

    assert paused.state == "paused" and listed == {sid: "paused"}
    assert resumed.state == "running" and fake.sandboxes[sid]["state"] == "running"
    posts = [path for method, path, _ in fake.requests if method == "POST"]
    assert posts[-2:] == [f"/v1/sandboxes/{sid}/pause", f"/v1/sandboxes/{sid}/resume"]


async def test_sdk_command_on_a_paused_sandbox_runs_and_leaves_it_running(fake: FakeApi) -> None:
    fake.scripts["echo hi"] = [("stdout", b"hi\n"), ("exit", 0, None, False)]
    sandbox = await _sdk_sandbox(fake)
    await sandbox.pause()

    result = await sandbox.commands.run("echo hi")

    assert result.stdout == "hi\n"
    assert (await sandbox.get_info()).state == "running"
    await sandbox.close()


async def test_negative_sdk_pause_of_a_sandbox_in_error_raises_conflict_naming_it(
    fake: FakeApi,
) -> None:
    sandbox = await _sdk_sandbox(fake)
    fake.sandboxes[sandbox.sandbox_id]["state"] = "error"
    with pytest.raises(Conflict, match="it is error"):
        await sandbox.pause()
    with pytest.raises(Conflict, match="it is error"):
        await sandbox.resume()
    await sandbox.close()
    assert fake.sandboxes[sandbox.sandbox_id]["state"] == "error"


async def test_negative_sdk_pause_of_a_deleted_sandbox_raises_not_found(fake: FakeApi) -> None:
    sandbox = await _sdk_sandbox(fake)
    del fake.sandboxes[sandbox.sandbox_id]
    with pytest.raises(NotFound):
        await sandbox.pause()
    await sandbox.close()


def test_sync_sandbox_pause_and_resume_wrap_the_async_core(fake: FakeApi) -> None:
    sandbox = Sandbox.create(api_url="http://space", api_key=API_KEY, _transport=fake.transport())
    try:
        assert sandbox.pause().state == "paused"
        assert sandbox.get_info().state == "paused"
        assert sandbox.resume().state == "running"
    finally:
        sandbox.close()


async def _list(fake: FakeApi) -> list[SandboxInfo]:
    return await AsyncSandbox.list(
        api_url="http://space", api_key=API_KEY, _transport=fake.transport()
    )
