"""The SDK against the real control-plane app over an in-memory node (no VMs).

Whole sessions through ``control_app``; the SDK's unit tests run against the same
app through tests/unit/_live_api.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from space.control.template_names import tenant_prefix
from space.node.api import PoolInfo as NodePoolInfo
from space.sdk import AsyncSandbox, PoolInfo
from space.sdk.errors import AuthenticationError, Conflict, NotFound, Unavailable
from tests.unit.fakes import FakeNode, control_app

pytestmark = pytest.mark.anyio


async def test_sdk_drives_the_control_plane_through_a_whole_session(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")["Authorization"].removeprefix("Bearer ")
        transport = httpx.ASGITransport(app=h.app)
        sandbox = await AsyncSandbox.create(cpus=2, api_key=key, _transport=transport)
        listed = await AsyncSandbox.list(api_key=key, _transport=transport)
        chunks: list[str] = []
        result = await sandbox.commands.run(["echo", "hi"], on_stdout=chunks.append)
        handle = await sandbox.commands.run("sleep", background=True)
        processes = await sandbox.commands.list()
        written = await sandbox.files.write("/home/user/a.txt", iter([b"ab", b"cd"]))
        text = await sandbox.files.read("/home/user/a.txt")
        entries = await sandbox.files.list("/home/user")
        with pytest.raises(Unavailable, match="channel broke"):
            await sandbox.commands.run(["fail-midway"])
        assert await sandbox.kill() is True
        with pytest.raises(NotFound):
            await AsyncSandbox.connect(sandbox.sandbox_id, api_key=key, _transport=transport)
        with pytest.raises(AuthenticationError):
            await AsyncSandbox.list(api_key="sk_space_wrong", _transport=transport)
    assert [s.sandbox_id for s in listed] == [sandbox.sandbox_id] and listed[0].cpus == 2
    assert (result.stdout, result.stderr, result.exit_code, "".join(chunks)) == (
        "hi\n", "err", 0, "hi\n"
    )  # fmt: skip
    assert handle.process_id in [p.process_id for p in processes]
    assert (written.size, text, [e.name for e in entries]) == (4, "abcd", ["a.txt"])


async def test_sdk_drives_the_sandbox_lifecycle_through_the_control_plane(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")["Authorization"].removeprefix("Bearer ")
        connect: dict[str, Any] = {"api_key": key, "_transport": httpx.ASGITransport(app=h.app)}
        sandbox = await AsyncSandbox.create(idle_timeout_s=600, **connect)
        hibernated = await sandbox.hibernate()
        woken = await sandbox.resume()
        timeouts = await sandbox.set_timeouts(idle_timeout_s=None, max_lifetime_s=3600)
        first = await sandbox.snapshot("first")
        second = await sandbox.snapshot("second")
        with pytest.raises(Conflict) as taken:
            await sandbox.snapshot("first")
        own = await sandbox.snapshots()
        restored = await sandbox.restore(first)
        children = await sandbox.fork(2)
        clone = await AsyncSandbox.create(from_snapshot=second, **connect)
        clone_info = await clone.get_info()
        await AsyncSandbox.delete_snapshot(first, **connect)
        await AsyncSandbox.delete_snapshot(first.snapshot_id, **connect)  # idempotent
        left = await AsyncSandbox.list_snapshots(**connect)
        for each in (sandbox, clone, *children):
            assert await each.kill() is True
    assert (hibernated.state, woken.state) == ("hibernated", "running")
    assert (timeouts.idle_timeout_s, timeouts.max_lifetime_s) == (None, 3600)
    assert second.parent_id == first.snapshot_id
    assert taken.value.details.get("snapshot_id") == first.snapshot_id
    assert {s.snapshot_id for s in own} == {first.snapshot_id, second.snapshot_id}
    assert (restored.state, restored.head_snapshot) == ("running", first.snapshot_id)
    assert len({c.sandbox_id for c in children} | {sandbox.sandbox_id}) == 3
    assert (clone_info.head_snapshot, clone_info.state) == (second.snapshot_id, "running")
    assert [(s.snapshot_id, s.parent_id) for s in left] == [(second.snapshot_id, None)]


async def test_sdk_reads_the_warm_pools_the_control_plane_gathers_from_its_nodes(
    tmp_path: Path,
) -> None:
    node = FakeNode()
    node.pools = [
        NodePoolInfo("base", 1, 2, 0, 4, hits=1, misses=3),
        NodePoolInfo(f"{tenant_prefix('acme')}py:v1", *[0] * 6),
    ]
    async with control_app(tmp_path, node) as h:
        key = h.key("acme")["Authorization"].removeprefix("Bearer ")
        transport = httpx.ASGITransport(app=h.app)
        pools = await AsyncSandbox.list_pools(api_key=key, _transport=transport)
    assert pools == [
        PoolInfo("local", "base", 1, 2, 0, 4, hits=1, misses=3, hit_rate=0.25),
        PoolInfo("local", "py:v1", 0, 0, 0, 0, hits=0, misses=0, hit_rate=None),
    ]
