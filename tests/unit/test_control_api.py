"""The REST API over a FakeNode: auth, sandboxes, exec, processes, files, errors."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.control import NodeRegistry, create_key, list_keys, revoke_key
from space.control.keys import VERDICT_TTL_S
from space.node.api import (
    CapacityInfo,
    Conflict,
    InsufficientCapacity,
    InvalidArgument,
    NodeError,
    NodeInfo,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Timeout,
    Unavailable,
)
from tests.unit.fakes import FakeNode, Harness, control_app

# DB-level: each test runs on SQLite and on PostgreSQL (issue 19).
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("on_both_databases")]


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "details"}
    error: dict[str, Any] = body["error"]
    return error


async def _create(h: Harness, headers: dict[str, str], **body: Any) -> dict[str, Any]:
    response = await h.client.post("/v1/sandboxes", json=body, headers=headers)
    assert response.status_code == 201, response.text
    sandbox: dict[str, Any] = response.json()
    return sandbox


async def test_negative_requests_without_a_key_answer_401_json(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        response = await h.client.get("/v1/sandboxes")
        assert response.status_code == 401
        assert _error(response)["code"] == "unauthenticated"


async def test_negative_an_unknown_key_answers_401(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        response = await h.client.get("/v1/sandboxes", headers={"X-API-Key": "sk_space_nope"})
        assert response.status_code == 401
        assert _error(response)["code"] == "unauthenticated"


async def test_negative_a_revoked_key_answers_401_once_the_replicas_verdict_ran_out(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = create_key(h.settings, "acme")
        ok = await h.client.get("/v1/sandboxes", headers={"X-API-Key": key})
        assert ok.status_code == 200
        (info,) = list_keys(h.settings, "acme")
        revoke_key(h.settings, info.id)
        h.clock.now += VERDICT_TTL_S - 0.1  # this replica still trusts its verdict
        trusted = await h.client.get("/v1/sandboxes", headers={"X-API-Key": key})
        assert trusted.status_code == 200
        h.clock.now += 0.1  # no longer: the key is looked up again, and refused
        response = await h.client.get("/v1/sandboxes", headers={"X-API-Key": key})
        assert response.status_code == 401
        assert _error(response)["code"] == "unauthenticated"


async def test_create_list_get_and_delete_a_sandbox(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sandbox = await _create(h, headers, cpus=2, memory_mib=512, env={"A": "1"})
        assert sandbox["state"] == "running"
        assert sandbox["cpus"] == 2 and sandbox["memory_mib"] == 512
        assert sandbox["node_id"] == "local" and sandbox["env"] == {"A": "1"}
        assert sandbox["expires_at"] is not None  # the default lifetime applies
        assert sandbox["id"] in h.node.boxes
        listed = (await h.client.get("/v1/sandboxes", headers=headers)).json()["sandboxes"]
        assert [s["id"] for s in listed] == [sandbox["id"]]
        got = await h.client.get(f"/v1/sandboxes/{sandbox['id']}", headers=headers)
        assert got.json() == sandbox
        deleted = await h.client.delete(f"/v1/sandboxes/{sandbox['id']}", headers=headers)
        assert deleted.status_code == 204
        assert sandbox["id"] not in h.node.boxes
        again = await h.client.delete(f"/v1/sandboxes/{sandbox['id']}", headers=headers)
        assert again.status_code == 204
        gone = await h.client.get(f"/v1/sandboxes/{sandbox['id']}", headers=headers)
        assert gone.status_code == 404


async def test_a_null_timeout_means_the_sandbox_never_expires(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        sandbox = await _create(h, h.key("acme"), timeout_s=None)
        assert sandbox["expires_at"] is None


async def test_negative_an_unknown_sandbox_id_answers_404(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        response = await h.client.get("/v1/sandboxes/sb-nope", headers=h.key("acme"))
        assert response.status_code == 404
        assert _error(response)["code"] == "not_found"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"cpus": 0}, "cpus"),
        ({"cpus": 9}, "cpus"),
        ({"memory_mib": 16385}, "memory_mib"),
        ({"memory_mib": 127}, "memory_mib"),
        ({"disk_mib": 511}, "disk_mib"),
        ({"timeout_s": 86401}, "timeout_s"),
        ({"cpus": "2"}, "cpus"),
        ({"colour": "blue"}, "colour"),
    ],
)
async def test_negative_invalid_sandbox_bodies_answer_422_and_create_nothing(
    tmp_path: Path, body: dict[str, Any], field: str
) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        response = await h.client.post("/v1/sandboxes", json=body, headers=headers)
        assert response.status_code == 422
        error = _error(response)
        assert error["code"] == "invalid_argument"
        assert field in error["message"]
        assert h.node.boxes == {}
        assert (await h.client.get("/v1/sandboxes", headers=headers)).json()["sandboxes"] == []


async def test_limits_at_the_exact_boundary_are_accepted(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        body = {"cpus": 8, "memory_mib": 16384, "disk_mib": 65536, "timeout_s": 86400}
        assert (await _create(h, h.key("acme"), **body))["cpus"] == 8


async def test_a_failed_creation_answers_the_node_error_and_keeps_the_row_in_error(
    tmp_path: Path,
) -> None:
    node = FakeNode()
    node.fail_create = Unavailable("boot failed: no memory left")
    async with control_app(tmp_path, node) as h:
        headers = h.key("acme")
        response = await h.client.post("/v1/sandboxes", json={}, headers=headers)
        assert response.status_code == 503
        error = _error(response)
        sandbox_id = error["details"]["sandbox_id"]
        got = (await h.client.get(f"/v1/sandboxes/{sandbox_id}", headers=headers)).json()
        assert got["state"] == "error" and "no memory left" in got["error"]
        # The row is written before the node is asked: create came after nothing else.
        assert node.calls[0] == ("create_sandbox", sandbox_id)


def _full(node_id: str, *, available: int = 40) -> FakeNode:
    node = FakeNode(node_id)
    node.fail_create = InsufficientCapacity(
        f"{node_id} is full", resource="memory", needed=160, available=available
    )
    return node


def _nodes(*nodes: FakeNode) -> NodeRegistry:
    registry = NodeRegistry()
    for node in nodes:
        registry.register(node.node_id, node)
    return registry


async def test_negative_a_create_no_node_has_room_for_answers_503_and_records_nothing(
    tmp_path: Path,
) -> None:
    node = _full("local")
    async with control_app(tmp_path, node) as h:
        headers = h.key("acme")
        response = await h.client.post("/v1/sandboxes", json={}, headers=headers)
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "30"
        error = _error(response)
        assert error["code"] == "capacity" and "local is full" in error["message"]
        assert error["details"] == {
            "resource": "memory",
            "needed": 160,
            "available": 40,
            "unit": "MiB",
            "retry_after_s": 30,
        }  # no sandbox id: the sandbox never existed
        assert (await h.client.get("/v1/sandboxes", headers=headers)).json()["sandboxes"] == []
        assert [call for call, _ in node.calls] == ["create_sandbox"]  # no delete either


async def test_a_create_a_full_node_refuses_is_placed_on_the_next_node(tmp_path: Path) -> None:
    full, roomy = _full("n1"), FakeNode("n2")  # equally loaded: n1, the smaller id, first
    async with control_app(tmp_path, full, registry=_nodes(full, roomy)) as h:
        headers = h.key("acme")
        sandbox = await _create(h, headers)
        assert sandbox["state"] == "running" and sandbox["id"] in roomy.boxes
        assert sandbox["node_id"] == "n2"
        assert full.calls == [("create_sandbox", sandbox["id"])]
        # The row followed it: later calls go to the node that runs it.
        response = await h.client.delete(f"/v1/sandboxes/{sandbox['id']}", headers=headers)
        assert response.status_code == 204
        assert ("delete_sandbox", sandbox["id"]) in roomy.calls
        assert not any(call == "delete_sandbox" for call, _ in full.calls)


async def test_negative_when_every_node_refuses_the_answer_says_how_many_were_asked(
    tmp_path: Path,
) -> None:
    first, second = _full("n1"), _full("n2", available=7)
    async with control_app(tmp_path, first, registry=_nodes(first, second)) as h:
        headers = h.key("acme")
        response = await h.client.post("/v1/sandboxes", json={}, headers=headers)
        assert response.status_code == 503
        error = _error(response)
        assert error["message"].startswith("none of the 2 nodes has room; the last: n2 is full")
        assert error["details"]["available"] == 7
        assert (await h.client.get("/v1/sandboxes", headers=headers)).json()["sandboxes"] == []


class _Silent(FakeNode):
    async def info(self) -> NodeInfo:
        raise Unavailable("node unreachable")


async def test_operators_read_each_nodes_capacity_with_the_node_token(tmp_path: Path) -> None:
    roomy, silent = FakeNode("n1"), _Silent("n2")
    roomy.capacity = CapacityInfo(
        memory_total_mib=24576,
        memory_available_mib=20000,
        memory_starting_mib=160,
        memory_reserve_mib=2457,
        memory_committed_mib=3520,
        memory_commit_limit_mib=44238,
        pool_total_mib=20480,
        pool_free_mib=15000,
        pool_kept_mib=256,
        pool_reserve_mib=2048,
        starting=1,
        max_sandboxes=None,
        room=115,
    )
    async with control_app(tmp_path, roomy, registry=_nodes(roomy, silent)) as h:
        await _create(h, h.key("acme"))
        token = {"Authorization": f"Bearer {h.app.state.ctx.node_token}"}
        response = await h.client.get("/v1/nodes", headers=token)
        assert response.status_code == 200
        first, second = response.json()["nodes"]
        now, lease_s = h.clock.now, h.settings.node_lease_s
        assert first == {
            "node_id": "n1",
            "url": "local",
            "state": "active",
            "lease_expires_at": now + lease_s,
            "last_seen": now,
            # Its heartbeat's report (the embedded node's replica sends it).
            "reported": {
                "vcpus": os.cpu_count(),
                "memory_mib": 24576,
                "memory_available_mib": 20000,
                "disk_mib": 20480,
                "disk_free_mib": 15000,
                "guest_types": ["qemu"],
                "room": 115,
                "templates": ["base"],
                "pools": {},
                "archives": False,
            },
            "reachable": True,
            "sandboxes": 1,
            "capacity": dataclasses.asdict(roomy.capacity),
        }
        # It never reported itself: recorded, holding no lease, and not reachable now.
        assert second == {
            "node_id": "n2",
            "url": "local",
            "state": "active",
            "lease_expires_at": None,
            "last_seen": now,
            "reported": None,
            "reachable": False,
            "sandboxes": None,
            "capacity": None,
        }
        # Tenants' keys do not open it: it is the operator's view.
        refused = await h.client.get("/v1/nodes", headers=h.key("acme"))
        assert refused.status_code == 401


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


async def test_exec_answers_an_ndjson_stream_of_start_output_and_exit(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        body = {"argv": ["echo", "hi"]}
        response = await h.client.post(f"/v1/sandboxes/{sid}/exec", json=body, headers=headers)
        assert response.status_code == 200
        events = _events(response)
        assert events[0] == {"type": "start", "pid": 100, "process_id": "p1", "pty": False}
        assert events[1] == {"type": "stdout", "data": base64.b64encode(b"hi\n").decode()}
        assert events[2] == {"type": "stderr", "data": base64.b64encode(b"err").decode()}
        assert events[3] == {"type": "exit", "exit_code": 0, "signal": None, "timed_out": False}
        assert h.node.streams[0].closed


async def test_exec_passes_stdin_text_to_the_process(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        body = {"cmd": "cat", "stdin": "héllo"}
        response = await h.client.post(f"/v1/sandboxes/{sid}/exec", json=body, headers=headers)
        stdout = base64.b64decode(_events(response)[1]["data"])
        assert stdout == "cathéllo".encode()


async def test_a_failure_midway_ends_the_stream_with_an_error_line(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        body = {"argv": ["fail-midway"]}
        response = await h.client.post(f"/v1/sandboxes/{sid}/exec", json=body, headers=headers)
        events = _events(response)
        assert [e["type"] for e in events] == ["start", "stdout", "error"]
        assert events[-1]["code"] == "unavailable"


async def test_negative_an_error_before_the_process_starts_is_an_http_error(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        body = {"argv": ["true"], "cwd": "/missing"}
        response = await h.client.post(f"/v1/sandboxes/{sid}/exec", json=body, headers=headers)
        assert response.status_code == 404
        assert _error(response)["code"] == "not_found"


@pytest.mark.parametrize(
    "body",
    [{}, {"cmd": "a", "argv": ["a"]}, {"argv": []}, {"cmd": "x", "cwd": ""}, {"cmd": "x\0"}],
)
async def test_negative_malformed_exec_bodies_answer_422(
    tmp_path: Path, body: dict[str, Any]
) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        response = await h.client.post(f"/v1/sandboxes/{sid}/exec", json=body, headers=headers)
        assert response.status_code == 422
        assert _error(response)["code"] == "invalid_argument"
        assert h.node.boxes[sid].processes == {}


async def test_a_background_exec_answers_start_and_ends(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        body = {"cmd": "sleep 100", "background": True}
        response = await h.client.post(f"/v1/sandboxes/{sid}/exec", json=body, headers=headers)
        assert [e["type"] for e in _events(response)] == ["start"]


async def test_processes_are_listed_streamed_and_killed(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        url = f"/v1/sandboxes/{sid}"
        await h.client.post(f"{url}/exec", json={"argv": ["echo", "x"]}, headers=headers)
        processes = (await h.client.get(f"{url}/processes", headers=headers)).json()["processes"]
        assert [p["process_id"] for p in processes] == ["p1"]
        stream = await h.client.get(f"{url}/processes/p1/stream", headers=headers)
        assert [e["type"] for e in _events(stream)] == ["start", "stdout", "stderr", "exit"]
        killed = await h.client.post(
            f"{url}/processes/p1/kill", json={"signal": 15}, headers=headers
        )
        assert killed.status_code == 204
        assert h.node.boxes[sid].processes["p1"][0].signal == 15
        missing = await h.client.post(f"{url}/processes/p9/kill", json={}, headers=headers)
        assert missing.status_code == 404


async def test_a_20_mib_upload_and_download_keep_their_bytes(tmp_path: Path) -> None:
    payload = os.urandom(20 * 1024 * 1024)

    async def body() -> Any:
        for offset in range(0, len(payload), 256 * 1024):
            yield payload[offset : offset + 256 * 1024]

    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        url = f"/v1/sandboxes/{sid}/files"
        put = await h.client.put(
            url, params={"path": "/data.bin", "mode": "600"}, content=body(), headers=headers
        )
        assert put.status_code == 200, put.text
        assert put.json()["size"] == len(payload)
        # The node got the body in pieces, never as one 20 MiB chunk.
        assert max(h.node.upload_chunk_sizes) < len(payload)
        got = await h.client.get(url, params={"path": "/data.bin"}, headers=headers)
        assert got.status_code == 200
        assert got.headers["content-length"] == str(len(payload))
        assert hashlib.sha256(got.content).digest() == hashlib.sha256(payload).digest()


async def test_file_operations_list_stat_mkdir_rename_and_delete(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        url = f"/v1/sandboxes/{sid}/files"
        mkdir = await h.client.post(f"{url}/mkdir", json={"path": "/d"}, headers=headers)
        assert mkdir.json()["type"] == "dir"
        await h.client.put(url, params={"path": "/d/a"}, content=b"abc", headers=headers)
        renamed = await h.client.post(
            f"{url}/rename", json={"src": "/d/a", "dst": "/d/b"}, headers=headers
        )
        assert renamed.json()["path"] == "/d/b"
        listing = await h.client.get(f"{url}/list", params={"path": "/d"}, headers=headers)
        assert [e["name"] for e in listing.json()["entries"]] == ["b"]
        stat = await h.client.get(f"{url}/stat", params={"path": "/d/b"}, headers=headers)
        assert stat.json()["size"] == 3
        removed = await h.client.delete(url, params={"path": "/d/b"}, headers=headers)
        assert removed.status_code == 204
        assert "/d/b" not in h.node.boxes[sid].files


async def test_a_file_read_never_passes_the_size_its_stat_said(tmp_path: Path) -> None:
    """A file that grew after the guest's stat (or a guest sending more than it said)
    is cut at the stat's size, the Content-Length: the answer stays well-formed."""
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        h.node.boxes[sid].files["/log"] = b"0123456789"
        real = h.node.read_file

        async def grown(sandbox_id: str, path: str, user: str = "user") -> Any:
            reader = await real(sandbox_id, path, user)
            reader._data += b"appended after the stat"
            return reader

        h.node.read_file = grown  # type: ignore[method-assign]
        answer = await h.client.get(
            f"/v1/sandboxes/{sid}/files", params={"path": "/log"}, headers=headers
        )
        assert answer.status_code == 200 and answer.content == b"0123456789"


@pytest.mark.parametrize(
    "params", [{"path": ""}, {}, {"path": "/a\0b"}, {"path": "/" + "a" * 4096}]
)
async def test_negative_bad_paths_answer_422_and_reach_no_node(
    tmp_path: Path, params: dict[str, str]
) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        calls = list(h.node.calls)
        response = await h.client.get(
            f"/v1/sandboxes/{sid}/files/stat", params=params, headers=headers
        )
        assert response.status_code == 422
        assert _error(response)["code"] == "invalid_argument"
        assert h.node.calls == calls


async def test_a_path_of_exactly_4096_bytes_is_accepted(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        params = {"path": "/" + "a" * 4095}
        response = await h.client.get(
            f"/v1/sandboxes/{sid}/files/stat", params=params, headers=headers
        )
        assert response.status_code == 404  # valid, just missing on the node


async def test_negative_mkdir_of_an_existing_path_answers_409(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        response = await h.client.post(
            f"/v1/sandboxes/{sid}/files/mkdir", json={"path": "/"}, headers=headers
        )
        assert response.status_code == 409
        assert _error(response)["code"] == "conflict"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (NotFound("x"), 404),
        (Conflict("x"), 409),
        (InvalidArgument("x"), 422),
        (PermissionDenied("x"), 403),
        (ResourceExhausted("x"), 429),
        (Timeout("x"), 504),
        (Unavailable("x"), 503),
        (InsufficientCapacity("x"), 503),
        (NodeError("x"), 500),
    ],
)
async def test_node_errors_map_to_their_http_status_and_code(
    tmp_path: Path, error: NodeError, status: int
) -> None:
    async with control_app(tmp_path) as h:
        headers = h.key("acme")
        sid = (await _create(h, headers))["id"]
        h.node.fail_next = error
        response = await h.client.get(
            f"/v1/sandboxes/{sid}/files/stat", params={"path": "/"}, headers=headers
        )
        assert response.status_code == status
        assert _error(response)["code"] == error.code


async def test_negative_an_unknown_route_answers_404_json(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        response = await h.client.get("/v1/nothing", headers=h.key("acme"))
        assert response.status_code == 404
        assert _error(response)["code"] == "not_found"
