"""Warm pools: creates of a template's ready shape take a paused, already woken VM.

The node here keeps two pool VMs of the base template. A hit hands the VM (with its
volume and run directory, which keep their names) to the new sandbox's record and gives
it a fresh identity; the pool refills behind it. Every operation on a pool hit is in
test_conformance.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from space.node.api import PoolInfo, SandboxSpec, SandboxState
from space.node.core.config import NodeConfig

from .conftest import NodeHarness, started_node
from .platform import qemu_pids
from .test_lifecycle import _sh

pytestmark = pytest.mark.vm

POOL = 2


@pytest.fixture
def warm(node_config: NodeConfig) -> Iterator[NodeHarness]:
    with started_node(replace(node_config, warm_pool_min=POOL, warm_pool_max=POOL)) as harness:
        yield harness


def _base_pool(h: NodeHarness) -> PoolInfo:
    (info,) = [p for p in h.run(h.node.info()).pools if p.template == "base:latest"]
    return info


def _pool(h: NodeHarness) -> tuple[int, int, int]:
    info = _base_pool(h)
    return info.size, info.hits, info.misses


def _wait_full(h: NodeHarness, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _base_pool(h).size < POOL:
        assert time.monotonic() < deadline, "the warm pool did not fill"
        h.run(asyncio.sleep(0.2))  # the node's loop runs (and refills) only in h.run


def test_creates_take_pool_vms_that_become_independent_sandboxes(warm: NodeHarness) -> None:
    _wait_full(warm)
    vms_before = set(qemu_pids(warm.config.data_dir))

    for sid in ("hot-1", "hot-2"):
        status = warm.run(warm.node.create_sandbox(SandboxSpec(sid, memory_mib=256)))
        assert status.state == SandboxState.RUNNING
        assert status.vmm_pid in vms_before  # an existing VM, handed over

    assert _pool(warm)[1:] == (2, 0)
    assert [s.sandbox_id for s in warm.run(warm.node.list_sandboxes())] == ["hot-1", "hot-2"]
    assert [_sh(warm, sid, "hostname") for sid in ("hot-1", "hot-2")] == ["hot-1", "hot-2"]
    ids = {_sh(warm, sid, "cat /etc/machine-id") for sid in ("hot-1", "hot-2")}
    draws = {_sh(warm, sid, "head -c 32 /dev/urandom | od -An -tx1") for sid in ("hot-1", "hot-2")}
    assert len(ids) == 2 and len(draws) == 2
    _sh(warm, "hot-1", "echo one > /home/user/f")
    assert _sh(warm, "hot-2", "ls /home/user") == ""
    # The VM keeps the volume it was woken on (QEMU reopens its disk by path): the
    # sandbox's record names it.
    volume = json.loads((warm.config.data_dir / "sandboxes" / "hot-1.json").read_text())["volume"]
    assert volume.startswith("pool-") and warm.node.pool.sandbox_path(volume).is_dir()
    _wait_full(warm)  # refilled behind the hits


def test_a_handed_over_sandbox_survives_a_node_restart_and_the_pool_refills(
    warm: NodeHarness,
) -> None:
    _wait_full(warm)
    warm.run(warm.node.create_sandbox(SandboxSpec("kept", memory_mib=256)))
    _sh(warm, "kept", "echo kept > /home/user/k")

    warm.restart()

    assert warm.run(warm.node.get_sandbox("kept")).state == SandboxState.RUNNING
    assert _sh(warm, "kept", "cat /home/user/k") == "kept"
    assert [s.sandbox_id for s in warm.run(warm.node.list_sandboxes())] == ["kept"]
    _wait_full(warm)
    warm.run(warm.node.delete_sandbox("kept"))
    assert len(qemu_pids(warm.config.data_dir)) == POOL  # only the pool's own VMs remain
