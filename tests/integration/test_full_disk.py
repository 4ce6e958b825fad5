"""A full disk never takes a VM down; one tenant's disk never fills the pool (issue 17).

Probe 5 of issue 17, on a node with a small pool: a disk that does not fit is refused
before anything is stored; a guest that writes zeros until its disk is full gets ENOSPC
from its own ext4 while another sandbox answers throughout, the pool keeps its room and
both VMs run on; the full one can still save its RAM. And where thin disks written
together do fill a pool, their guests get write errors and no VM stops.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from space.node.agent import Node
from space.node.api import (
    ExecExited,
    ExecOutput,
    ExecRequest,
    InsufficientCapacity,
    SandboxSpec,
    SandboxState,
)
from space.node.core.capacity import volume_limit_mib
from space.node.core.config import NodeConfig

from .conftest import started_node

pytestmark = [pytest.mark.vm, pytest.mark.timeout(300)]

#: A's disk is the smallest a sandbox may have (its writes take TCG a minute); B has
#: the ready state's shape, so it wakes in seconds. A 6 GiB pool holds both volumes.
DISK_MIB, MEMORY_MIB = 1024, 256
_FILL = "dd if=/dev/zero of=/root/fill bs=4M oflag=direct; echo dd=$?; df -m / | tail -1"


async def _run(node: Node, sandbox_id: str, cmd: str) -> tuple[str, int | None]:
    stream = await node.exec(sandbox_id, ExecRequest(cmd=cmd, user="root", timeout_s=240))
    out, code = b"", None
    async for event in stream:
        if isinstance(event, ExecOutput):
            out += event.data
        elif isinstance(event, ExecExited):
            code = event.exit_code
    return out.decode(errors="replace"), code


async def _answers_while(node: Node, sandbox_id: str, busy: asyncio.Task[object]) -> list[float]:
    """Exec ``echo`` in ``sandbox_id`` over and over until ``busy`` is done; each one's
    seconds (each must answer)."""
    times = []
    while not busy.done():
        start = time.monotonic()
        assert await _run(node, sandbox_id, "echo ok") == ("ok\n", 0)
        times.append(time.monotonic() - start)
        await asyncio.sleep(0.5)
    return times


async def _scenario(node: Node, pool_root: Path) -> None:
    assert (await node.create_sandbox(SandboxSpec("b"))).state == SandboxState.RUNNING

    # The probe's disk: refused as no room, and nothing of it is kept.
    with pytest.raises(InsufficientCapacity) as refused:
        await node.create_sandbox(SandboxSpec("a", memory_mib=MEMORY_MIB, disk_mib=16384))
    assert refused.value.resource == "pool" and refused.value.code == "capacity"
    assert [s.sandbox_id for s in await node.list_sandboxes()] == ["b"]
    assert not (pool_root / "sandboxes" / "a").exists()

    spec = SandboxSpec("a", memory_mib=MEMORY_MIB, disk_mib=DISK_MIB)
    assert (await node.create_sandbox(spec)).state == SandboxState.RUNNING
    fill = asyncio.create_task(_run(node, "a", _FILL))
    answered = await _answers_while(node, "b", fill)
    out, code = await fill
    assert code == 0 and "No space left on device" in out and "dd=1" in out, out
    assert len(answered) >= 3 and max(answered) < 30, answered
    # The guest's own ext4 ran out, not its volume's quota: no I/O error in the guest.
    dmesg, _ = await _run(node, "a", "dmesg | grep -ci 'i/o error' || true")
    assert dmesg.strip() == "0", dmesg

    # The pool kept its room and both VMs run on.
    os.sync()
    stat = os.statvfs(pool_root)
    free_mib = stat.f_bavail * stat.f_frsize >> 20
    assert free_mib > 1024, f"pool left with {free_mib} MiB"
    referenced = await node.pool.referenced_bytes(pool_root / "sandboxes" / "a")
    assert referenced <= volume_limit_mib(DISK_MIB, MEMORY_MIB) << 20
    for sid in ("a", "b"):
        assert (await node.get_sandbox(sid)).state == SandboxState.RUNNING
        assert await _run(node, sid, "echo ok") == ("ok\n", 0)
    # A's full disk leaves the room its quota keeps to save its RAM: it hibernates.
    assert (await node.hibernate_sandbox("a")).state == SandboxState.HIBERNATED
    assert (await node.resume_sandbox("a")).state == SandboxState.RUNNING
    assert await _run(node, "a", "echo ok") == ("ok\n", 0)
    await _run(node, "a", "rm /root/fill")
    for sid in ("a", "b"):
        await node.delete_sandbox(sid)
    assert await node.list_sandboxes() == []


def test_a_guest_filling_its_disk_gets_enospc_while_the_pool_and_other_sandboxes_live_on(
    node_config: NodeConfig, tmp_path: Path
) -> None:
    config = replace(node_config, data_dir=tmp_path / "node", pool_size_gib=6)
    with started_node(config) as h:
        h.run(_scenario(h.node, h.node.pool.root))


async def _fill_the_pool(node: Node, pool_root: Path) -> None:
    ids = ["c", "d", "e"]
    for sid in ids:
        assert (await node.create_sandbox(SandboxSpec(sid))).state == SandboxState.RUNNING
    results = await asyncio.gather(*(_run(node, sid, _FILL) for sid in ids))
    os.sync()
    stat = os.statvfs(pool_root)
    free_mib = stat.f_bavail * stat.f_frsize >> 20
    # Thin disks written together do fill the pool: the writes past it failed in the
    # guests (as ENOSPC from their ext4 or an I/O error from their disk).
    assert free_mib < 256, (free_mib, results)
    assert all("dd=1" in out for out, _ in results), results
    for sid in ids:
        assert (await node.get_sandbox(sid)).state == SandboxState.RUNNING
        assert await _run(node, sid, "echo ok") == ("ok\n", 0)
    for sid in ids:
        await node.delete_sandbox(sid)
    assert await node.list_sandboxes() == []


def test_a_pool_filled_by_thin_disks_stops_no_vm(node_config: NodeConfig, tmp_path: Path) -> None:
    # 5 GiB: room for three default volumes' limits by admission, not for three disks
    # written full (3 x 1.8 GiB).
    config = replace(node_config, data_dir=tmp_path / "node", pool_size_gib=5)
    with started_node(config) as h:
        h.run(_fill_the_pool(h.node, h.node.pool.root))
