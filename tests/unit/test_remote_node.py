"""RemoteNode against the node's HTTP API, in-process: the multi-host seam."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from space.control import NodeRegistry
from space.node.errors import (
    Conflict,
    InvalidArgument,
    NodeError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Timeout,
    Unavailable,
)
from space.node.http_api import create_node_app
from space.node.interface import ExecExited, ExecOutput, ExecRequest, SandboxSpec, SandboxState
from space.node.remote import RemoteNode
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
