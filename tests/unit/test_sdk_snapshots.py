"""The SDK's snapshots against the real API: take, list, delete, restore, create from one."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from space.node.api import SandboxState
from space.sdk import AsyncSandbox, Sandbox, SnapshotInfo
from space.sdk.errors import Conflict, InternalError, InvalidArgument, NotFound, Unavailable
from tests.unit._live_api import LiveApi
from tests.unit._sdk_calls import bodies as _bodies
from tests.unit._sdk_calls import connection as _connection
from tests.unit._sdk_calls import create as _create

pytestmark = pytest.mark.anyio

#: A well-formed Snapshot object as the API sends it.
WIRE_SNAPSHOT: dict[str, Any] = {
    "id": "snp0001",
    "name": "clean",
    "sandbox_id": "sbx0001",
    "parent_id": None,
    "node_id": "local",
    "created_at": "2026-11-30T12:01:00+00:00",
    "template": "base",
    "cpus": 2,
    "memory_mib": 512,
    "disk_mib": 2048,
    "memory_bytes": 536870912,
    "exclusive_bytes": None,
}


# take and list


async def test_snapshot_posts_its_name_and_parses_the_answer(api: LiveApi) -> None:
    sandbox = await _create(api, cpus=2, memory_mib=512)
    snapshot = await sandbox.snapshot("clean")
    info = await sandbox.get_info()
    await sandbox.close()

    assert _bodies(api, f"/v1/sandboxes/{sandbox.sandbox_id}/snapshots") == [{"name": "clean"}]
    assert isinstance(snapshot, SnapshotInfo)
    assert (snapshot.name, snapshot.sandbox_id, snapshot.parent_id) == (
        "clean", sandbox.sandbox_id, None
    )  # fmt: skip
    # FakeNode's memory image is a quarter of the sandbox's memory.
    assert (snapshot.cpus, snapshot.memory_mib, snapshot.memory_bytes) == (2, 512, 128 << 20)
    assert snapshot.created_at.tzinfo is not None and snapshot.exclusive_bytes is None
    assert info.head_snapshot == snapshot.snapshot_id


async def test_snapshots_chain_by_parent_and_list_per_sandbox_or_for_the_tenant(
    api: LiveApi,
) -> None:
    first = await _create(api)
    other = await _create(api)
    a = await first.snapshot("a")
    b = await first.snapshot("b")
    c = await other.snapshot("c")

    own = await first.snapshots()
    everything = await AsyncSandbox.list_snapshots(**_connection(api))
    filtered = await AsyncSandbox.list_snapshots(sandbox_id=other.sandbox_id, **_connection(api))
    await first.close()
    await other.close()

    assert b.parent_id == a.snapshot_id and b.exclusive_bytes is None  # measured later
    assert [s.snapshot_id for s in own] == [a.snapshot_id, b.snapshot_id]
    assert {s.snapshot_id for s in everything} == {a.snapshot_id, b.snapshot_id, c.snapshot_id}
    assert [s.snapshot_id for s in filtered] == [c.snapshot_id]
    gets = [path for method, path, _ in api.requests if method == "GET"]
    assert gets == [
        f"/v1/sandboxes/{first.sandbox_id}/snapshots",
        "/v1/snapshots",
        f"/v1/sandboxes/{other.sandbox_id}/snapshots",
    ]


async def test_negative_a_taken_name_raises_conflict_keeping_message_and_snapshot_id(
    api: LiveApi,
) -> None:
    sandbox = await _create(api)
    first = await sandbox.snapshot("clean")
    with pytest.raises(Conflict) as caught:
        await sandbox.snapshot("clean")
    await sandbox.close()
    error = caught.value
    assert error.message == f"sandbox {sandbox.sandbox_id} already has a snapshot named 'clean'"
    assert error.details == {"sandbox_id": sandbox.sandbox_id, "snapshot_id": first.snapshot_id}
    assert (error.operation, error.sandbox_id) == ("sandbox.snapshot", sandbox.sandbox_id)
    assert list(api.node.snapshots) == [first.snapshot_id]


async def test_negative_listing_the_snapshots_of_an_unknown_sandbox_raises_not_found(
    api: LiveApi,
) -> None:
    with pytest.raises(NotFound):
        await AsyncSandbox.list_snapshots(sandbox_id="sbx9999", **_connection(api))
    with pytest.raises(InvalidArgument, match="not a valid sandbox id"):
        await AsyncSandbox.list_snapshots(sandbox_id="../snapshots", **_connection(api))
    assert len(api.requests) == 1


# delete


async def test_delete_snapshot_accepts_info_or_id_is_idempotent_and_reparents(
    api: LiveApi,
) -> None:
    sandbox = await _create(api)
    a = await sandbox.snapshot("a")
    b = await sandbox.snapshot("b")
    c = await sandbox.snapshot("c")

    await AsyncSandbox.delete_snapshot(b, **_connection(api))
    await AsyncSandbox.delete_snapshot(b.snapshot_id, **_connection(api))
    left = await sandbox.snapshots()
    await sandbox.close()

    deletes = [path for method, path, _ in api.requests if method == "DELETE"]
    assert deletes == [f"/v1/snapshots/{b.snapshot_id}"] * 2
    assert [(s.snapshot_id, s.parent_id) for s in left] == [
        (a.snapshot_id, None), (c.snapshot_id, a.snapshot_id)
    ]  # fmt: skip


@pytest.mark.parametrize("bad_id", ["", "../sandboxes/sbx0001", "a/b", ".hidden", "x" * 129])
async def test_negative_a_snapshot_id_that_is_not_one_path_segment_is_refused_before_sending(
    api: LiveApi, bad_id: str
) -> None:
    sandbox = await _create(api)
    sent = len(api.requests)
    with pytest.raises(InvalidArgument, match="not a valid snapshot id"):
        await AsyncSandbox.delete_snapshot(bad_id, **_connection(api))
    with pytest.raises(InvalidArgument, match="not a valid snapshot id"):
        await sandbox.restore(bad_id)
    await sandbox.close()
    assert len(api.requests) == sent


# restore


async def test_restore_posts_the_snapshot_id_and_answers_the_running_sandbox(
    api: LiveApi,
) -> None:
    sandbox = await _create(api)
    a = await sandbox.snapshot("a")
    await sandbox.snapshot("b")
    await sandbox.pause()

    by_info = await sandbox.restore(a)
    by_id = await sandbox.restore(a.snapshot_id)
    await sandbox.close()

    assert _bodies(api, "/restore") == [{"snapshot_id": a.snapshot_id}] * 2
    assert (by_info.state, by_info.head_snapshot) == ("running", a.snapshot_id)
    assert replace(by_id, last_active_at=None) == replace(by_info, last_active_at=None)


async def test_negative_restore_errors_map_to_their_leaves_with_the_server_message(
    api: LiveApi,
) -> None:
    sandbox = await _create(api)
    snapshot = await sandbox.snapshot("a")
    other = await _create(api, cpus=2)
    with pytest.raises(NotFound):
        await sandbox.restore("snp9999")
    with pytest.raises(InvalidArgument, match=r"differs from sandbox sb-\w+ in cpus"):
        await other.restore(snapshot)
    await api.set_node_state(sandbox.sandbox_id, SandboxState.ERROR)
    with pytest.raises(Conflict, match=r"cannot restore sandbox sb-\w+: it is error"):
        await sandbox.restore(snapshot)
    await sandbox.close()
    await other.close()


# create from a snapshot


async def test_create_from_snapshot_sends_only_its_id_and_inherits_its_sizes(
    api: LiveApi,
) -> None:
    source = await _create(api, cpus=2, memory_mib=512)
    snapshot = await source.snapshot("warm")
    from_info = await _create(api, from_snapshot=snapshot, idle_timeout_s=30)
    from_id = await _create(api, from_snapshot=snapshot.snapshot_id)
    info = await from_info.get_info()
    for sandbox in (source, from_info, from_id):
        await sandbox.close()

    bodies = _bodies(api, "/v1/sandboxes")[1:]
    assert [body["from_snapshot"] for body in bodies] == [snapshot.snapshot_id] * 2
    assert all(not {"template", "cpus", "memory_mib", "disk_mib"} & b.keys() for b in bodies)
    assert (info.cpus, info.memory_mib, info.head_snapshot) == (2, 512, snapshot.snapshot_id)
    assert info.idle_timeout_s == 30


@pytest.mark.parametrize(
    "size", [{"template": "base"}, {"cpus": 1}, {"memory_mib": 256}, {"disk_mib": 2048}]
)
async def test_negative_create_from_snapshot_with_a_size_is_refused_before_sending(
    api: LiveApi, size: dict[str, Any]
) -> None:
    with pytest.raises(InvalidArgument, match="from_snapshot sets"):
        await _create(api, from_snapshot="snp0001", **size)
    assert api.requests == [] and api.node.boxes == {}


async def test_negative_create_from_an_unknown_snapshot_raises_not_found(api: LiveApi) -> None:
    with pytest.raises(NotFound):
        await _create(api, from_snapshot="snp9999")
    assert api.node.boxes == {}


# parsing


def test_snapshot_info_parses_times_as_aware_datetimes_and_sizes_as_ints() -> None:
    info = SnapshotInfo.from_wire({**WIRE_SNAPSHOT, "parent_id": "snp0000", "exclusive_bytes": 7})
    assert info.created_at == datetime(2026, 11, 30, 12, 1, tzinfo=UTC)
    assert (info.snapshot_id, info.parent_id, info.exclusive_bytes) == ("snp0001", "snp0000", 7)


MALFORMED: list[tuple[str, Any]] = [
    ("id", None),
    ("name", ""),
    ("sandbox_id", 5),
    ("cpus", "2"),
    ("memory_bytes", True),
    ("memory_bytes", -1),
    ("exclusive_bytes", 1.5),
    ("parent_id", 3),
    ("created_at", "yesterday"),
    ("created_at", "2026-11-30T12:01:00"),  # no zone: ambiguous
    ("created_at", 1764504060),  # the API sends ISO 8601 strings
]


@pytest.mark.parametrize(("key", "value"), MALFORMED)
def test_negative_a_malformed_snapshot_field_raises_internal_error(key: str, value: Any) -> None:
    with pytest.raises(InternalError, match="malformed snapshot"):
        SnapshotInfo.from_wire({**WIRE_SNAPSHOT, key: value})


@pytest.mark.parametrize("key", ["id", "name", "created_at", "memory_bytes", "template"])
def test_negative_a_snapshot_missing_a_field_raises_internal_error(key: str) -> None:
    body = {k: v for k, v in WIRE_SNAPSHOT.items() if k != key}
    with pytest.raises(InternalError, match="malformed snapshot"):
        SnapshotInfo.from_wire(body)


@pytest.mark.parametrize(
    "answer", [{"snapshots": {}}, {}, [], {"snapshots": ["x"]}, {"snapshots": [{"id": "s"}]}]
)
async def test_negative_a_malformed_snapshot_list_raises_internal_error(answer: Any) -> None:
    transport = httpx.MockTransport(lambda _request: httpx.Response(200, json=answer))
    with pytest.raises(InternalError):
        await AsyncSandbox.list_snapshots(api_key="sk-test", _transport=transport)


async def test_negative_a_transport_failure_during_a_snapshot_call_raises_unavailable() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(Unavailable, match="cannot reach the API") as caught:
        await AsyncSandbox.delete_snapshot("snp0001", _transport=httpx.MockTransport(refuse))
    assert caught.value.operation == "snapshot.delete"


# the sync facade


def test_sync_snapshot_restore_list_and_delete_wrap_the_async_core(sync_api: LiveApi) -> None:
    api = sync_api
    sandbox = Sandbox.create(**_connection(api))
    try:
        snapshot = sandbox.snapshot("a")
        assert [s.snapshot_id for s in sandbox.snapshots()] == [snapshot.snapshot_id]
        assert sandbox.restore(snapshot).head_snapshot == snapshot.snapshot_id
        assert Sandbox.list_snapshots(**_connection(api)) == [snapshot]
        Sandbox.delete_snapshot(snapshot, **_connection(api))
        assert Sandbox.list_snapshots(**_connection(api)) == []
    finally:
        sandbox.close()
