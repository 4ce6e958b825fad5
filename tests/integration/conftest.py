"""Shared VM fixtures: a node on a loop-file btrfs pool in a temp data dir.

``node_config`` gives a NodeConfig whose data dir is private to the test session (the
image cache is the machine's shared one, so the guest image is built once per machine).
``node`` starts a Node for one test and, on teardown, deletes every sandbox, unmounts
the pool and checks that no QEMU process, mount or loop device of that data dir is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from space.node.agent import Node
from space.node.core.config import NodeConfig
from space.node.network import netns
from space.node.privileged.cgroups import VmCgroups

from .. import logs
from .platform import gateway_pids, mounts_under, processes_naming, qemu_pids, settled

T = TypeVar("T")


def loops_of(image: Path) -> list[str]:
    out = subprocess.run(
        ["losetup", "-l", "-n", "-O", "NAME", "-j", str(image)],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return out.split()


def release_data_dir(data_dir: Path) -> list[str]:
    """Kill, unmount and detach whatever is left of a node's data dir; say what was."""
    left = [f"qemu pid {pid}" for pid in qemu_pids(data_dir)]
    for pid in qemu_pids(data_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run_dir = NodeConfig(data_dir=data_dir).effective_run_dir
    # A gVisor sandbox's runsc and channel relay outlive the node agent, as QEMU does.
    for pid in processes_naming(f"{run_dir}/"):
        left.append(f"process {pid}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for mount in sorted(mounts_under(run_dir), reverse=True):
        left.append(f"mount {mount}")
        subprocess.run(["umount", "-l", mount], check=False)
    pool = data_dir / "pool"
    if os.path.ismount(pool):
        left.append(f"mount {pool}")
        subprocess.run(["umount", "-l", str(pool)], check=False)
    for loop in settled(lambda: loops_of(data_dir / "pool.img")):
        left.append(f"loop {loop}")
        subprocess.run(["losetup", "-d", loop], check=False)
    for name in netns.node_netns(run_dir):
        left.append(f"network namespace {name}")
        for each in (name, netns.guest_netns(name)):  # a gVisor guest's second one too
            subprocess.run(["ip", "netns", "delete", each], check=False, capture_output=True)
    for pid in gateway_pids(data_dir):
        left.append(f"egress gateway pid {pid}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    cgroups = VmCgroups(run_dir.name)
    for base in cgroups.bases:
        if base.exists():
            left.append(f"cgroup {base}")
    cgroups.sweep()
    cgroups.remove_bases()
    return left


@dataclass
class NodeHarness:
    """A started Node and the event loop it lives on (tests are synchronous)."""

    config: NodeConfig
    runner: asyncio.Runner
    node: Node

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coro)

    def restart(self) -> Node:
        """Close the node (VMs keep running) and start a new one on the same config."""
        self.run(self.node.close())
        self.node = self.run(Node.start(self.config))
        return self.node


@pytest.fixture(scope="session")
def node_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeConfig]:
    if os.geteuid() != 0:
        pytest.fail("node tests boot QEMU VMs on a loop-mounted btrfs pool: run them as root")
    data_dir = tmp_path_factory.mktemp("node")
    logs.register(data_dir)
    yield NodeConfig(data_dir=data_dir, pool_size_gib=8, boot_timeout_s=90.0)
    leaked = release_data_dir(data_dir)
    assert not leaked, f"left behind by the node tests: {leaked}"


@contextlib.contextmanager
def started_node(config: NodeConfig) -> Iterator[NodeHarness]:
    """A Node on ``config`` for one test; on exit every sandbox is deleted, the pool
    unmounted, and nothing of the data dir may be left."""
    logs.register(config.data_dir, config.effective_run_dir)
    runner = asyncio.Runner()
    try:
        harness = NodeHarness(config, runner, runner.run(Node.start(config)))
        try:
            yield harness
        finally:
            harness.run(harness.node.shutdown(unmount_pool=True))
    finally:
        runner.close()
        leaked = release_data_dir(config.data_dir)
        assert not leaked, f"left behind after node shutdown: {leaked}"


@pytest.fixture
def node(node_config: NodeConfig) -> Iterator[NodeHarness]:
    with started_node(node_config) as harness:
        yield harness
