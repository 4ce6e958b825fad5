"""A fake SPACE API, built only from docs/api.md, for testing the SDK and CLI without VMs.

Commands do not run: a test scripts what an exec answers (``FakeApi.scripts``), keyed by
the shell string or the argv joined with spaces. Snapshots are records only (restore and
fork copy the sandbox's record). tests/unit/test_sdk_fake_contract.py pins the fake itself
to the contract, so the SDK tests do not test the SDK against a wrong fake.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import tarfile
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.unit._fake_api_egress import create_policy, egress_routes

API_KEY = "sk-test-key"
#: What a snapshot fixes about a sandbox (create from_snapshot must leave them out).
SIZES = ("template", "cpus", "memory_mib", "disk_mib")
#: States in which hibernate, resume, snapshot, restore and fork are allowed.
LIVE = ("running", "paused", "hibernated")
_EPOCH = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

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
    snapshots: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Names of the templates built (the archive is read, not checked).
    templates: list[str] = field(default_factory=list)
    #: Pool objects ``GET /v1/pools`` answers, as given (docs/api.md, "Warm pools").
    pools: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    #: (method, path, JSON body) of every create and lifecycle request, in order.
    bodies: list[tuple[str, str, Any]] = field(default_factory=list)
    exec_bodies: list[dict[str, Any]] = field(default_factory=list)
    upload_chunks: list[int] = field(default_factory=list)
    #: What ``GET .../egress/log`` answers per sandbox (wire dicts; default: canned).
    egress_events: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
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
            Route(base + "/{sid}/hibernate", self._hibernate, methods=["POST"]),
            Route(base + "/{sid}/timeouts", self._timeouts, methods=["PUT"]),
            Route(base + "/{sid}/snapshots", self._take_snapshot, methods=["POST"]),
            Route(base + "/{sid}/snapshots", self._sandbox_snapshots, methods=["GET"]),
            Route(base + "/{sid}/restore", self._restore, methods=["POST"]),
            Route(base + "/{sid}/fork", self._fork, methods=["POST"]),
            Route("/v1/snapshots", self._all_snapshots, methods=["GET"]),
            Route("/v1/snapshots/{snap}", self._get_snapshot, methods=["GET"]),
            Route("/v1/snapshots/{snap}", self._delete_snapshot, methods=["DELETE"]),
            Route("/v1/pools", self._pools, methods=["GET"]),
            Route("/v1/templates", self._build_template, methods=["POST"]),
            Route("/v1/templates/{ref}", self._delete_template, methods=["DELETE"]),
            *egress_routes(self, base),
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

    # templates

    async def _build_template(self, request: Request) -> Response:
        spec = _spec_of(await request.body())
        name, tag = spec["name"], spec.get("tag", "latest")
        self.templates.append(f"{name}:{tag}")
        template = {
            "name": name, "tag": tag, "digest": "d" * 64, "created_at": "2026-11-30T12:00:00Z",
            "base": spec["base"], "cpus": 1, "memory_mib": 256, "disk_mib": 2048,
            "env": spec.get("env", {}), "workdir": spec.get("workdir"),
            "start": spec.get("start"), "ready": True,
        }  # fmt: skip
        lines = [
            {"type": "log", "line": "step 1/1 config"},
            {"type": "template", "template": template},
        ]
        body = "".join(json.dumps(line) + "\n" for line in lines)
        return Response(body, media_type="application/x-ndjson")

    async def _delete_template(self, request: Request) -> Response:
        ref = request.path_params["ref"]
        if ref not in self.templates and f"{ref}:latest" not in self.templates:
            return _error(404, "not_found", f"no template {ref}")
        self.templates = [t for t in self.templates if t not in (ref, f"{ref}:latest")]
        return Response(status_code=204)

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

    async def _body(self, request: Request) -> Any:
        body = await request.json()
        self.bodies.append((request.method, request.url.path, body))
        return body

    # sandboxes

    async def _create(self, request: Request) -> Response:
        body = await self._body(request)
        if not 1 <= body.get("cpus", 1) <= 8:
            return _error(422, "invalid_argument", "cpus must be 1-8")
        source = body.get("from_snapshot")
        if source is not None:
            if set(SIZES) & body.keys():
                return _error(422, "invalid_argument", "from_snapshot fixes the sizes")
            if source not in self.snapshots:
                return _missing()
            body = {**body, **{key: self.snapshots[source][key] for key in SIZES}}
        egress = create_policy(self, body)
        if isinstance(egress, str):
            return _error(422, "invalid_argument", egress)
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
            "idle_timeout_s": body.get("idle_timeout_s"),
            "max_lifetime_s": body.get("timeout_s", 300),
            "last_active_at": "2026-11-30T12:00:00Z",
            "head_snapshot": source,
            "egress": egress,
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

    async def _hibernate(self, request: Request) -> Response:
        return self._transition(request, "hibernate", "hibernated")

    def _transition(self, request: Request, action: str, state: str) -> Response:
        """Between running, paused and hibernated, idempotent; any other state is 409."""
        sandbox = self._sandbox(request)
        if sandbox is None:
            return _missing()
        if (refusal := _refuse(sandbox, action)) is not None:
            return refusal
        sandbox["state"] = state
        return JSONResponse(sandbox)

    async def _timeouts(self, request: Request) -> Response:
        sandbox = self._sandbox(request)
        if sandbox is None:
            return _missing()
        body = await self._body(request)
        known = body.keys() <= {"idle_timeout_s", "max_lifetime_s"}
        if not known or not all(_seconds(value) for value in body.values()):
            return _error(422, "invalid_argument", f"bad timeouts: {body}")
        sandbox.update(body)
        return JSONResponse(sandbox)

    # commands

    async def _exec(self, request: Request) -> Response:
        sandbox = self._sandbox(request)
        if sandbox is None:
            return _missing()
        if sandbox.get("state") in ("paused", "hibernated"):
            sandbox["state"] = "running"  # guest operations resume a sandbox first
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

    # snapshots, restore and fork

    async def _take_snapshot(self, request: Request) -> Response:
        sandbox = self._sandbox(request)
        if sandbox is None:
            return _missing()
        name = (await self._body(request))["name"]
        for taken in self.snapshots.values():
            if (taken["sandbox_id"], taken["name"]) == (sandbox["id"], name):
                message = f"a snapshot named {name!r} exists"
                return _error(409, "conflict", message, {"snapshot_id": taken["id"]})
        if (refusal := _refuse(sandbox, "snapshot")) is not None:
            return refusal
        number = next(self._ids)
        snapshot = {
            "id": f"snp{number:04d}",
            "name": name,
            "sandbox_id": sandbox["id"],
            "parent_id": sandbox.get("head_snapshot"),
            "node_id": "local",
            "created_at": (_EPOCH + timedelta(minutes=number)).isoformat(),
            **{key: sandbox[key] for key in SIZES},
            "memory_bytes": sandbox["memory_mib"] << 20,
            "exclusive_bytes": None if sandbox.get("head_snapshot") is None else 3 << 20,
        }
        self.snapshots[snapshot["id"]] = snapshot
        sandbox["head_snapshot"] = snapshot["id"]
        return JSONResponse(snapshot, status_code=201)

    async def _sandbox_snapshots(self, request: Request) -> Response:
        if (sandbox := self._sandbox(request)) is None:
            return _missing()
        listing = [s for s in self.snapshots.values() if s["sandbox_id"] == sandbox["id"]]
        return JSONResponse({"snapshots": listing})

    async def _all_snapshots(self, request: Request) -> Response:
        return JSONResponse({"snapshots": list(self.snapshots.values())})

    async def _get_snapshot(self, request: Request) -> Response:
        snapshot = self.snapshots.get(request.path_params["snap"])
        return JSONResponse(snapshot) if snapshot else _missing()

    async def _delete_snapshot(self, request: Request) -> Response:
        gone = self.snapshots.pop(request.path_params["snap"], None)
        for snapshot in self.snapshots.values():
            if gone is not None and snapshot["parent_id"] == gone["id"]:
                snapshot["parent_id"] = gone["parent_id"]  # children are re-parented
        return Response(status_code=204)

    async def _restore(self, request: Request) -> Response:
        sandbox = self._sandbox(request)
        snapshot = self.snapshots.get((await self._body(request))["snapshot_id"])
        if sandbox is None or snapshot is None:
            return _missing()
        if any(sandbox[key] != snapshot[key] for key in SIZES):
            return _error(422, "invalid_argument", "the snapshot's sizes differ")
        if (refusal := _refuse(sandbox, "restore")) is not None:
            return refusal
        sandbox.update(state="running", head_snapshot=snapshot["id"])
        return JSONResponse(sandbox)

    async def _fork(self, request: Request) -> Response:
        if (sandbox := self._sandbox(request)) is None:
            return _missing()
        count = (await self._body(request))["count"]
        if type(count) is not int or not 1 <= count <= 16:
            return _error(422, "invalid_argument", f"count must be 1-16, got {count!r}")
        if (refusal := _refuse(sandbox, "fork")) is not None:
            return refusal
        children = []
        for _ in range(count):
            child = {**sandbox, "id": f"sbx{next(self._ids):04d}", "state": "running"}
            self.sandboxes[child["id"]] = child
            children.append(child)
            for (sid, path), data in list(self.files.items()):  # a fork copies the disk
                if sid == sandbox["id"]:
                    self.files[(child["id"], path)] = data
        return JSONResponse({"sandboxes": children}, status_code=201)

    # warm pools

    async def _pools(self, request: Request) -> Response:
        return JSONResponse({"pools": self.pools})


def _refuse(sandbox: dict[str, Any], action: str) -> Response | None:
    """409 naming the state unless ``action`` is allowed in it (a LIVE state)."""
    state = sandbox.get("state")
    if state in LIVE:
        return None
    message = f"cannot {action} sandbox {sandbox['id']}: it is {state}"
    return _error(409, "conflict", message, {"state": state})


def _seconds(value: Any) -> bool:
    return value is None or (type(value) is int and value >= 1)


def _spec_of(archive: bytes) -> dict[str, Any]:
    """The ``space.toml`` of a gzip'd tar build context."""
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        member = tar.extractfile("space.toml")
        assert member is not None
        return tomllib.loads(member.read().decode())


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
