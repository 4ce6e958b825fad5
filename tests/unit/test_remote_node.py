"""RemoteNode against the node's HTTP API, in-process: the multi-host seam."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from space.control import NodeRegistry
from space.node.api import (
    NODE_API_PREFIX,
    CapacityInfo,
    Conflict,
    ExecExited,
    ExecOutput,
    ExecRequest,
    InsufficientCapacity,
    InvalidArgument,
    NodeError,
    NodeInfo,
    NotFound,
    PermissionDenied,
    PoolInfo,
    ProcessSelector,
    PtySize,
    ResourceExhausted,
    SandboxSpec,
    SandboxState,
    SandboxStatus,
    SnapshotInfo,
    Timeout,
    Unavailable,
    encode,
)
from space.node.http.client import RemoteNode
from space.node.http.server import create_node_app
from tests.unit.fakes import FakeNode, control_app

pytestmark = pytest.mark.anyio

TOKEN = "node-secret"


@contextlib.asynccontextmanager
async def remote(node: FakeNode, token: str = TOKEN) -> AsyncIterator[RemoteNode]:
    transport = httpx.ASGITransport(app=create_node_app(node, TOKEN))
    client = RemoteNode("http://node", token, transport=transport)
    try:
        yield client
    finally:
        await client.aclose()


def _status(sandbox_id: str, state: SandboxState, head: str | None = None) -> SandboxStatus:
    # Every optional field set and a fractional time, so a dropped field shows.
    return SandboxStatus(
        sandbox_id, state, "base", 2, 512, 4096, 1_800_000_000.25, 4242, "note", head
    )


def _info(snapshot_id: str, sandbox_id: str) -> SnapshotInfo:
    return SnapshotInfo(
        snapshot_id, sandbox_id, "snap-0", 1_800_000_001.5, "base", 2, 512, 4096, 123_456_789, 77
    )


class LifecycleNode(FakeNode):
    """FakeNode with canned lifecycle answers; ``recorded`` holds (method, args) of each.

    ``fail_lifecycle`` is raised by the next lifecycle call instead of answering.
    """

    def __init__(self) -> None:
        super().__init__()
        self.recorded: list[tuple[str, tuple[object, ...]]] = []
        self.fail_lifecycle: NodeError | None = None
        self.canned_snapshots: dict[str, SnapshotInfo] = {}

    def _canned_call(self, method: str, *args: object) -> None:
        self.recorded.append((method, args))
        if self.fail_lifecycle is not None:
            error, self.fail_lifecycle = self.fail_lifecycle, None
            raise error

    async def create_sandbox(self, spec: SandboxSpec) -> SandboxStatus:
        self._canned_call("create_sandbox", spec)
        if spec.from_snapshot is not None:  # no snapshot exists here: answer as the node
            return _status(spec.sandbox_id, SandboxState.RUNNING)
        return await super().create_sandbox(spec)

    async def hibernate_sandbox(self, sandbox_id: str) -> SandboxStatus:
        self._canned_call("hibernate_sandbox", sandbox_id)
        return _status(sandbox_id, SandboxState.HIBERNATED)

    async def snapshot_sandbox(self, sandbox_id: str, snapshot_id: str) -> SnapshotInfo:
        self._canned_call("snapshot_sandbox", sandbox_id, snapshot_id)
        info = self.canned_snapshots[snapshot_id] = _info(snapshot_id, sandbox_id)
        return info

    async def list_snapshots(self) -> list[SnapshotInfo]:
        self._canned_call("list_snapshots")
        return list(self.canned_snapshots.values())

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        self._canned_call("get_snapshot", snapshot_id)
        if snapshot_id not in self.canned_snapshots:
            raise NotFound(f"no snapshot {snapshot_id}")
        return self.canned_snapshots[snapshot_id]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        self._canned_call("delete_snapshot", snapshot_id)
        self.canned_snapshots.pop(snapshot_id, None)

    async def restore_sandbox(self, sandbox_id: str, snapshot_id: str) -> SandboxStatus:
        self._canned_call("restore_sandbox", sandbox_id, snapshot_id)
        return _status(sandbox_id, SandboxState.RUNNING, snapshot_id)

    async def fork_sandbox(self, sandbox_id: str, child_ids: list[str]) -> list[SandboxStatus]:
        self._canned_call("fork_sandbox", sandbox_id, child_ids)
        return [_status(child, SandboxState.RUNNING, "snap-0") for child in child_ids]


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for offset in range(0, len(data), size):
        yield data[offset : offset + size]


async def test_sandboxes_round_trip_through_the_node_api() -> None:
    node = FakeNode()
    async with remote(node) as client:
        status = await client.create_sandbox(SandboxSpec("sb-1", cpus=2, env={"A": "b"}))
        assert status.state is SandboxState.RUNNING and status.cpus == 2
        assert await client.get_sandbox("sb-1") == status
        assert await client.list_sandboxes() == [status]
        assert (await client.info()).sandboxes == 1
        await client.delete_sandbox("sb-1")
        assert node.boxes == {}


async def test_exec_streams_events_and_closing_reaches_the_node() -> None:
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        stream = await client.exec("sb-1", ExecRequest(cmd="x", stdin=b"\x00\xff"))
        assert (stream.pid, stream.process_id) == (100, "p1")
        events = [event async for event in stream]
        await stream.aclose()
        assert events == [
            ExecOutput("stdout", b"x\x00\xff"),
            ExecOutput("stderr", b"err"),
            ExecExited(0, None),
        ]
        attached = await client.attach("sb-1", "p1")
        assert [e async for e in attached][-1] == ExecExited(0, None)
        await attached.aclose()
        await client.kill_process("sb-1", "p1", 15)
        (info,) = await client.list_processes("sb-1")
        assert info.signal == 15 and not info.running


async def test_a_followed_background_exec_crosses_the_wire_and_streams_its_events() -> None:
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        node.scripts["x"] = [ExecOutput("stdout", b"out"), ExecExited(0, None)]
        request = ExecRequest(cmd="x", background=True, follow=True, tag="t")
        stream = await client.exec("sb-1", request)
        events = [event async for event in stream]
        await stream.aclose()
        assert node.exec_requests == [request]
        assert events == [ExecOutput("stdout", b"out"), ExecExited(0, None)]
        (info,) = await client.list_processes("sb-1")
        assert info.process_id == stream.process_id and info.tag == "t"


async def test_an_attach_by_pid_or_tag_crosses_the_wire_with_the_terminal_flag() -> None:
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        node.scripts["t"] = [ExecOutput("stdout", b"out"), ExecExited(0, None)]
        request = ExecRequest(cmd="t", background=True, tag="job", pty=PtySize(5, 40))
        started = await client.exec("sb-1", request)
        for selector in (ProcessSelector(pid=started.pid), ProcessSelector(tag="job")):
            attached = await client.attach("sb-1", selector)
            assert (attached.process_id, attached.pty) == (started.process_id, True)
            assert [e async for e in attached] == [
                ExecOutput("stdout", b"out"),
                ExecExited(0, None),
            ]
            await attached.aclose()
        with pytest.raises(NotFound):
            await client.attach("sb-1", ProcessSelector(tag="other"))
    # A request that selects by both (or neither) is refused before the node is asked.
    transport = httpx.ASGITransport(app=create_node_app(node, TOKEN))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as raw:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        both_or_neither: list[dict[str, str | int]] = [{"pid": 100, "tag": "job"}, {}]
        for params in both_or_neither:
            answer = await raw.get(
                f"{NODE_API_PREFIX}/sandboxes/sb-1/processes/attach", params=params, headers=headers
            )
            assert answer.status_code == 422, answer.text
            assert answer.json()["error"]["code"] == "invalid_argument"


async def test_an_error_midway_is_raised_from_the_stream() -> None:
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        stream = await client.exec("sb-1", ExecRequest(argv=["fail-midway"]))
        seen = []
        with pytest.raises(Unavailable, match="channel broke"):
            async for event in stream:
                seen.append(event)
        await stream.aclose()
        assert seen == [ExecOutput("stdout", b"partial")]


async def test_files_travel_whole_in_both_directions() -> None:
    node = FakeNode()
    payload = os.urandom(3 * 1024 * 1024 + 7)
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        stat = await client.write_file("sb-1", "/f", _chunks(payload, 65536), mode=0o600)
        assert stat.size == len(payload)
        reader = await client.read_file("sb-1", "/f")
        assert reader.stat == stat
        data = b"".join([chunk async for chunk in reader])
        await reader.aclose()
        assert hashlib.sha256(data).digest() == hashlib.sha256(payload).digest()
        assert (await client.make_dir("sb-1", "/d")).type == "dir"
        assert (await client.rename("sb-1", "/f", "/d/g")).path == "/d/g"
        assert [s.name for s in await client.list_dir("sb-1", "/d")] == ["g"]
        assert (await client.stat("sb-1", "/d/g")).size == len(payload)
        await client.remove("sb-1", "/d/g")
        assert "/d/g" not in node.boxes["sb-1"].files


@pytest.mark.parametrize(
    "error",
    [
        NotFound("gone"),
        Conflict("exists"),
        InvalidArgument("bad"),
        PermissionDenied("no"),
        ResourceExhausted("full"),
        Timeout("slow"),
        Unavailable("down"),
        InsufficientCapacity("no room"),
    ],
)
async def test_node_errors_come_back_as_the_same_leaf(error: NodeError) -> None:
    node = FakeNode()
    async with remote(node) as client:
        await client.create_sandbox(SandboxSpec("sb-1"))
        node.fail_next = error
        with pytest.raises(type(error), match=error.message) as raised:
            await client.stat("sb-1", "/")
        assert type(raised.value) is type(error)
        assert raised.value.sandbox_id == "sb-1"


async def test_a_capacity_refusal_comes_back_with_what_ran_short_and_when_to_retry() -> None:
    node = FakeNode()
    node.fail_create = InsufficientCapacity(
        "no room", resource="memory", needed=160, available=40, retry_after_s=12
    )
    async with remote(node) as client:
        with pytest.raises(InsufficientCapacity) as raised:
            await client.create_sandbox(SandboxSpec("sb-1"))
    refusal = raised.value
    assert (refusal.resource, refusal.needed, refusal.available, refusal.unit) == (
        "memory",
        160,
        40,
        "MiB",
    )
    assert refusal.retry_after_s == 12 and refusal.message == "no room"


async def test_the_node_api_answers_a_capacity_refusal_503_with_retry_after() -> None:
    node = FakeNode()
    node.fail_create = InsufficientCapacity("no room", resource="pool", needed=256, available=-3)
    transport = httpx.ASGITransport(app=create_node_app(node, TOKEN))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        answer = await client.post(
            "/node/v1/sandboxes",
            json=encode(SandboxSpec("sb-1")),
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "30"
    assert answer.json()["error"] == {
        "code": "capacity",
        "message": "no room",
        "details": {
            "resource": "pool",
            "needed": 256,
            "available": -3,
            "unit": "MiB",
            "retry_after_s": 30,
        },
    }


@pytest.mark.parametrize(
    "details",
    [{}, {"needed": "lots", "retry_after_s": True}, {"retry_after_s": -5}, "not an object"],
)
async def test_negative_malformed_capacity_details_still_make_a_capacity_refusal(
    details: object,
) -> None:
    body = {"error": {"code": "capacity", "message": "full", "details": details}}
    async with _mocked(_canned(503, body)) as client:
        with pytest.raises(InsufficientCapacity, match="full") as raised:
            await client.create_sandbox(SandboxSpec("sb-1"))
    assert raised.value.needed == 0 and raised.value.retry_after_s >= 1


async def test_negative_a_wrong_token_is_unavailable_and_reaches_no_node() -> None:
    node = FakeNode()
    async with remote(node, token="wrong") as client:
        with pytest.raises(Unavailable, match="token"):
            await client.create_sandbox(SandboxSpec("sb-1"))
    assert node.calls == []


async def test_negative_an_unreachable_node_is_unavailable() -> None:
    client = RemoteNode("http://127.0.0.1:9", TOKEN, timeout_s=2)
    try:
        with pytest.raises(Unavailable):
            await client.list_sandboxes()
    finally:
        await client.aclose()


async def test_negative_malformed_exec_bodies_are_refused_by_the_node_api() -> None:
    node = FakeNode()
    transport = httpx.ASGITransport(app=create_node_app(node, TOKEN))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as http:
        await node.create_sandbox(SandboxSpec("sb-1"))
        response = await http.post(
            "/node/v1/sandboxes/sb-1/exec", json={"cmd": "x", "stdin": "%%%"}, headers=headers
        )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_argument"
    assert node.boxes["sb-1"].processes == {}


async def test_a_remote_node_registered_with_the_node_token_runs_sandboxes(
    tmp_path: Path,
) -> None:
    remote_node = FakeNode("far")
    node_app = create_node_app(remote_node, TOKEN)

    def factory(url: str, token: str) -> RemoteNode:
        return RemoteNode(url, token, transport=httpx.ASGITransport(app=node_app))

    registry = NodeRegistry(remote_factory=factory)
    (tmp_path / "node-token").write_text(TOKEN + "\n")
    async with control_app(tmp_path, FakeNode("unused"), registry=registry) as h:
        body = {"node_id": "far", "url": "http://far:7071"}
        refused = await h.client.post("/v1/nodes", json=body, headers={"Authorization": "Bearer x"})
        assert refused.status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        registered = await h.client.post("/v1/nodes", json=body, headers=auth)
        assert registered.status_code == 200, registered.text
        headers = h.key("acme")
        created = await h.client.post("/v1/sandboxes", json={}, headers=headers)
        assert created.json()["node_id"] == "far"
        sid = created.json()["id"]
        assert sid in remote_node.boxes
        response = await h.client.post(
            f"/v1/sandboxes/{sid}/exec", json={"argv": ["echo", "far"]}, headers=headers
        )
        assert '"type":"exit"' in response.text


async def test_a_full_remote_node_answers_the_client_503_capacity_naming_no_sandbox(
    tmp_path: Path,
) -> None:
    remote_node = FakeNode("far")
    remote_node.fail_create = InsufficientCapacity(
        "node has no room", resource="pool", needed=256, available=10, retry_after_s=20
    )
    node_app = create_node_app(remote_node, TOKEN)

    def factory(url: str, token: str) -> RemoteNode:
        return RemoteNode(url, token, transport=httpx.ASGITransport(app=node_app))

    registry = NodeRegistry(remote_factory=factory)
    (tmp_path / "node-token").write_text(TOKEN + "\n")
    async with control_app(tmp_path, FakeNode("unused"), registry=registry) as h:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        body = {"node_id": "far", "url": "http://far:7071"}
        assert (await h.client.post("/v1/nodes", json=body, headers=auth)).status_code == 200
        response = await h.client.post("/v1/sandboxes", json={}, headers=h.key("acme"))
    assert response.status_code == 503 and response.headers["Retry-After"] == "20"
    error = response.json()["error"]
    assert error["code"] == "capacity" and error["message"] == "node has no room"
    assert error["details"] == {
        "resource": "pool",
        "needed": 256,
        "available": 10,
        "unit": "MiB",
        "retry_after_s": 20,
    }


async def test_hibernate_snapshot_restore_and_fork_round_trip_through_the_node_api() -> None:
    node = LifecycleNode()
    async with remote(node) as client:
        hibernated = await client.hibernate_sandbox("sb-1")
        taken = await client.snapshot_sandbox("sb-1", "snap-1")
        restored = await client.restore_sandbox("sb-1", "snap-1")
        children = await client.fork_sandbox("sb-1", ["sb-2", "sb-3"])
    assert hibernated == _status("sb-1", SandboxState.HIBERNATED)
    assert taken == _info("snap-1", "sb-1")
    assert restored == _status("sb-1", SandboxState.RUNNING, "snap-1")
    assert children == [_status(c, SandboxState.RUNNING, "snap-0") for c in ("sb-2", "sb-3")]
    assert node.recorded == [
        ("hibernate_sandbox", ("sb-1",)),
        ("snapshot_sandbox", ("sb-1", "snap-1")),
        ("restore_sandbox", ("sb-1", "snap-1")),
        ("fork_sandbox", ("sb-1", ["sb-2", "sb-3"])),
    ]


async def test_snapshots_are_listed_fetched_and_deleted_through_the_node_api() -> None:
    node = LifecycleNode()
    async with remote(node) as client:
        assert await client.list_snapshots() == []
        first = await client.snapshot_sandbox("sb-1", "snap-1")
        second = await client.snapshot_sandbox("sb-2", "snap-2")
        assert await client.list_snapshots() == [first, second]
        assert await client.get_snapshot("snap-2") == second
        await client.delete_snapshot("snap-1")
        await client.delete_snapshot("snap-1")
        assert await client.list_snapshots() == [second]
    assert ("delete_snapshot", ("snap-1",)) in node.recorded


async def test_create_from_a_snapshot_carries_the_snapshot_id_to_the_node() -> None:
    node = LifecycleNode()
    spec = SandboxSpec("sb-9", cpus=2, memory_mib=512, disk_mib=4096, from_snapshot="snap-1")
    async with remote(node) as client:
        await client.create_sandbox(spec)
    assert node.recorded == [("create_sandbox", (spec,))]


_LIFECYCLE_CALLS: dict[str, Callable[[RemoteNode], Awaitable[object]]] = {
    "hibernate": lambda c: c.hibernate_sandbox("sb-1"),
    "snapshot": lambda c: c.snapshot_sandbox("sb-1", "snap-1"),
    "list_snapshots": lambda c: c.list_snapshots(),
    "get_snapshot": lambda c: c.get_snapshot("snap-1"),
    "delete_snapshot": lambda c: c.delete_snapshot("snap-1"),
    "restore": lambda c: c.restore_sandbox("sb-1", "snap-1"),
    "fork": lambda c: c.fork_sandbox("sb-1", ["sb-2"]),
}


@pytest.mark.parametrize("call", sorted(_LIFECYCLE_CALLS))
@pytest.mark.parametrize(
    "error",
    [
        Conflict("cannot hibernate sandbox sb-1: it is stopped"),
        NotFound("no snapshot snap-1"),
        InvalidArgument("snapshot snap-1 has 4 cpus, sandbox sb-1 has 2"),
        ResourceExhausted("disk full"),
    ],
    ids=lambda error: type(error).__name__,
)
async def test_lifecycle_errors_keep_their_class_and_message(call: str, error: NodeError) -> None:
    node = LifecycleNode()
    node.fail_lifecycle = error
    async with remote(node) as client:
        with pytest.raises(NodeError) as raised:
            await _LIFECYCLE_CALLS[call](client)
    assert type(raised.value) is type(error)
    assert raised.value.message == error.message
    assert len(node.recorded) == 1


async def test_negative_getting_an_unknown_snapshot_is_not_found() -> None:
    async with remote(LifecycleNode()) as client:
        with pytest.raises(NotFound, match="no snapshot snap-x"):
            await client.get_snapshot("snap-x")


def _canned(status: int, body: object) -> Callable[[httpx.Request], httpx.Response]:
    """A node that answers every request with ``status`` and ``body`` (bytes sent raw)."""

    def answer(request: httpx.Request) -> httpx.Response:
        if isinstance(body, bytes):
            return httpx.Response(status, content=body)
        return httpx.Response(status, json=body)

    return answer


@contextlib.asynccontextmanager
async def _mocked(handler: Callable[[httpx.Request], httpx.Response]) -> AsyncIterator[RemoteNode]:
    client = RemoteNode("http://node", TOKEN, transport=httpx.MockTransport(handler))
    try:
        yield client
    finally:
        await client.aclose()


_STATUS = encode(_status("sb-1", SandboxState.RUNNING))
_INFO = encode(_info("snap-1", "sb-1"))
_CONFLICT = {"error": {"code": "conflict", "message": "busy", "details": {}}}


@pytest.mark.parametrize(
    ("call", "status", "body"),
    [
        ("hibernate", 200, {}),
        ("hibernate", 200, b""),
        ("hibernate", 200, b"not json"),
        ("hibernate", 200, _STATUS | {"state": "exploded"}),
        ("hibernate", 200, _STATUS | {"sandbox_id": "sb-other"}),
        ("snapshot", 201, []),
        ("snapshot", 201, _INFO | {"snapshot_id": "snap-other"}),
        ("snapshot", 201, _INFO | {"sandbox_id": "sb-other"}),
        ("snapshot", 201, _INFO | {"cpus": "many"}),
        ("list_snapshots", 200, None),
        ("list_snapshots", 200, [_INFO]),
        ("list_snapshots", 200, {"snapshots": "snap-1"}),
        ("list_snapshots", 200, {"snapshots": [{"snapshot_id": 1}]}),
        ("get_snapshot", 200, {"snapshot_id": "snap-1"}),
        ("get_snapshot", 200, _INFO | {"snapshot_id": "snap-2"}),
        ("restore", 200, {"sandbox_id": "sb-1"}),
        ("fork", 200, [_STATUS | {"sandbox_id": "sb-2"}]),
        ("fork", 200, {"sandboxes": {}}),
        ("fork", 200, {"sandboxes": [_STATUS]}),
        ("fork", 200, {"sandboxes": [_STATUS | {"sandbox_id": "sb-2"}] * 2}),
        ("fork", 200, {"sandboxes": []}),
        ("delete_snapshot", 200, b"{"),
        ("restore", 409, {"error": "conflict"}),
        ("restore", 409, {"error": {"code": "conflict"}}),
        ("fork", 500, b"<html>bad gateway</html>"),
    ],
)
async def test_negative_malformed_node_answers_become_unavailable(
    call: str, status: int, body: object
) -> None:
    async with _mocked(_canned(status, body)) as client:
        with pytest.raises(Unavailable):
            await _LIFECYCLE_CALLS[call](client)


async def test_a_well_formed_canned_answer_parses_so_the_malformed_cases_can_fail() -> None:
    fork_body = {"sandboxes": [_STATUS | {"sandbox_id": "sb-2"}]}
    async with _mocked(_canned(200, fork_body)) as client:
        assert [c.sandbox_id for c in await client.fork_sandbox("sb-1", ["sb-2"])] == ["sb-2"]
    async with _mocked(_canned(200, {"snapshots": [_INFO]})) as client:
        assert await client.list_snapshots() == [_info("snap-1", "sb-1")]


@pytest.mark.parametrize(
    ("call", "read_timeout_s"),
    [
        ("hibernate", 120.0),
        ("snapshot", 120.0),
        ("restore", 120.0),
        ("fork", 120.0),
        ("list_snapshots", 30.0),
        ("get_snapshot", 30.0),
        ("delete_snapshot", 30.0),
    ],
)
async def test_memory_saving_calls_wait_long_and_quick_calls_keep_the_default(
    call: str, read_timeout_s: float
) -> None:
    timeouts: list[dict[str, float | None]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"])
        return httpx.Response(409, json=_CONFLICT)

    async with _mocked(answer) as client:
        with pytest.raises(Conflict, match="busy"):
            await _LIFECYCLE_CALLS[call](client)
    assert [t["read"] for t in timeouts] == [read_timeout_s]
    assert timeouts[0]["connect"] == 10.0


_POOL = PoolInfo("base", size=2, target=3, min_size=1, max_size=8, hits=40, misses=7)
_NODE_INFO = encode(NodeInfo("n1", "tcg", ["base"], 0, [_POOL]))


async def test_node_info_carries_the_warm_pools_through_the_node_api() -> None:
    node = FakeNode("n1")
    node.pools = [_POOL, PoolInfo("py", 0, 0, 0, 0, 0, 0)]
    async with remote(node) as client:
        info = await client.info()
    assert info == await node.info() and info.pools == node.pools


async def test_node_info_carries_the_capacity_figures_through_the_node_api() -> None:
    node = FakeNode("n1")
    node.capacity = CapacityInfo(
        24576, 20000, 160, 2457, 35200, 44238, 20480, 9000, 256, 2048, 1, None, 25
    )
    async with remote(node) as client:
        info = await client.info()
    assert info.capacity == node.capacity and info.capacity is not None
    assert info.capacity.room == 25
    async with _mocked(_canned(200, _NODE_INFO)) as client:  # a node that reports none
        assert (await client.info()).capacity is None


async def test_node_info_from_a_node_without_pools_has_none() -> None:
    old_node = {k: v for k, v in _NODE_INFO.items() if k != "pools"}
    async with _mocked(_canned(200, old_node)) as client:
        assert (await client.info()).pools == []
    async with _mocked(_canned(200, _NODE_INFO)) as client:
        assert (await client.info()).pools == [_POOL]


@pytest.mark.parametrize(
    "pools",
    [
        "base",
        [1],
        [{"template": "base"}],
        [_NODE_INFO["pools"][0] | {"size": "2"}],
        [_NODE_INFO["pools"][0] | {"hits": True}],
        [_NODE_INFO["pools"][0] | {"misses": 7.0}],
        [_NODE_INFO["pools"][0] | {"target": -1}],
        [_NODE_INFO["pools"][0] | {"template": ""}],
        [_NODE_INFO["pools"][0] | {"max_size": None}],
    ],
)
async def test_negative_a_malformed_pool_in_node_info_is_unavailable(pools: object) -> None:
    async with _mocked(_canned(200, _NODE_INFO | {"pools": pools})) as client:
        with pytest.raises(Unavailable, match="malformed"):
            await client.info()


async def test_archives_round_trip_through_the_node_api() -> None:
    """Every archive method over HTTP, against two fake nodes sharing a store: the
    answers come back whole, and the node's refusals keep their codes."""
    from tests.unit._fake_archives import FakeArchiveStore

    store = FakeArchiveStore()
    here, there = FakeNode("here", store), FakeNode("there", store)
    await here.create_sandbox(SandboxSpec("sb-1"))
    await here.hibernate_sandbox("sb-1")
    await here.snapshot_sandbox("sb-1", "sn-1")
    async with remote(here) as source, remote(there) as target:
        assert (await source.info()).archives
        status = await source.archive_sandbox("sb-1")
        assert status.state == SandboxState.HIBERNATED
        assert status.archive is not None and status.archive.startswith("sandboxes/sb-1/")
        assert (await source.get_sandbox("sb-1")).archive == status.archive

        result = await target.import_archive("sb-1", status.archive)
        assert result.status.sandbox_id == "sb-1" and result.status.archive == status.archive
        with pytest.raises(Conflict):
            await target.import_archive("sb-1", status.archive)  # it is there now

        await source.archive_snapshot("sn-1")
        fetched = await target.fetch_snapshot("sn-1")
        assert fetched.snapshot_id == "sn-1" and fetched.sandbox_id == "sb-1"

        await source.delete_archive(status.archive)
        with pytest.raises(NotFound):
            await target.import_archive("sb-2", status.archive)
        with pytest.raises(NotFound):
            await target.fetch_snapshot("sn-unknown")
    async with remote(FakeNode("alone")) as alone:
        assert not (await alone.info()).archives
        with pytest.raises(Unavailable, match="no artifact store"):
            await alone.archive_snapshot("sn-1")
