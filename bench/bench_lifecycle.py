"""Benchmark of the sandbox lifecycle on the node (issue 3).

Starts a Node directly (as tests/integration does) on a fresh data directory with a
loop-file btrfs pool, creates one 256 MiB sandbox from the base template's ready state
(as a default sandbox is) with a background process running and prints median and p90
of:
- pause and resume (QMP ``stop``/``cont`` + state persisted, clock synced on resume),
- exec of ``true`` on a running and on a paused sandbox (auto-resume included),
- hibernate, and resume from hibernate (until the guest answered and has its clock),
- snapshot (flush, pause, device state, btrfs snapshot, publish, resume) and the disk
  part alone (a read-only btrfs snapshot of the running sandbox's volume, after the
  flush that a snapshot does before pausing),
- restore in place, and fork of the live sandbox into one child (until it answers),
- the baseline beside them: a cold create (boot) of a sandbox of the same size (its
  disk a little larger, so it cannot start from the ready state), and each path's
  ratio to it; and a create from the ready state;
and the sizes: saved memory of a snapshot, and the disk an untouched snapshot holds
exclusively. Then, side by side on the same hibernated sandbox (issue 18): a state
save and a state load alone (QMP migration to or from ``vmstate``, no guest call),
sealed under the node's state key and plain as before, with the ratio. Everything
(VMs, pool mount, loop device) is removed at the end, also on failure.

The node runs as ``space serve`` runs it (issue 18): a child process starts the root
broker, drops to the node agent's user (``--user``, ``space`` by default; ``root``
keeps the agent root, as before issue 18) and prints its figures to the parent, which
cleans up as root. Usage: `.venv/bin/python bench/bench_lifecycle.py [--runs 20]
[--user space]` as root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._node_child import node_child
from bench._stats import summary
from space.node.agent import Node
from space.node.agent.node_user import become_node_user, node_user
from space.node.api import ExecExited, ExecRequest, SandboxSpec
from space.node.core.config import NodeConfig
from space.node.core.keys import NodeKeys
from space.node.core.sandbox import preflush
from space.node.core.template import READY_SHAPE
from space.node.vmm.qemu import QemuVM

_SANDBOX = "bench-lifecycle"
# A process that lives across every operation without keeping the vCPU busy: under
# TCG here each `sleep` spawned costs ~100 ms of guest CPU.
_BUSY = "while true; do echo x > /tmp/busy; sleep 1; done"
_COLD_BOOTS = 3
_TIMED = (
    "cold create (baseline)",
    "create from the ready state",
    "pause",
    "resume",
    "exec true (running)",
    "exec true (paused, auto-resume)",
    "hibernate",
    "resume from hibernate",
    "snapshot (disk + memory)",
    "disk snapshot (btrfs only)",
    "restore",
    "fork of a live sandbox (1 child)",
)
_STATES = ("save sealed", "save plain", "load sealed", "load plain")


async def _exec_true(node: Node) -> None:
    stream = await node.exec(_SANDBOX, ExecRequest(argv=["true"]))
    exits = [event async for event in stream if isinstance(event, ExecExited)]
    if [e.exit_code for e in exits] != [0]:
        raise RuntimeError(f"true did not exit 0: {exits}")


async def _timed_ms(operation: Awaitable[object]) -> float:
    start = time.perf_counter()
    await operation
    return (time.perf_counter() - start) * 1000


async def bench(node: Node, runs: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {name: [] for name in _TIMED}
    for _ in range(_COLD_BOOTS):
        results["cold create (baseline)"].append(await _timed_ms(_create(node, cold=True)))
        await node.delete_sandbox(_SANDBOX)
        results["create from the ready state"].append(await _timed_ms(_create(node)))
        await node.delete_sandbox(_SANDBOX)
    await _create(node)
    busy = await node.exec(_SANDBOX, ExecRequest(cmd=_BUSY, background=True))
    await busy.aclose()
    await _exec_true(node)
    for i in range(runs):
        await _round(node, i, results)
    return results


async def _create(node: Node, *, cold: bool = False) -> None:
    disk_mib = READY_SHAPE.disk_mib + (256 if cold else 0)
    await node.create_sandbox(SandboxSpec(_SANDBOX, memory_mib=256, disk_mib=disk_mib))


async def _round(node: Node, i: int, results: dict[str, list[float]]) -> None:
    async def timed(name: str, operation: Awaitable[object]) -> None:
        results[name].append(await _timed_ms(operation))

    await timed("pause", node.pause_sandbox(_SANDBOX))
    await timed("resume", node.resume_sandbox(_SANDBOX))
    await timed("exec true (running)", _exec_true(node))
    await node.pause_sandbox(_SANDBOX)
    await timed("exec true (paused, auto-resume)", _exec_true(node))
    await timed("hibernate", node.hibernate_sandbox(_SANDBOX))
    await timed("resume from hibernate", node.resume_sandbox(_SANDBOX))
    await timed("snapshot (disk + memory)", node.snapshot_sandbox(_SANDBOX, f"s{i}"))
    await preflush(node.pool.sandbox_path(_SANDBOX))  # as a snapshot does before its pause
    await timed("disk snapshot (btrfs only)", node.pool.snapshot_volume(_SANDBOX, f"d{i}"))
    await node.pool.delete_snapshot(f"d{i}")
    await timed("restore", node.restore_sandbox(_SANDBOX, f"s{i}"))
    await timed("fork of a live sandbox (1 child)", node.fork_sandbox(_SANDBOX, [f"c{i}"]))
    await node.delete_sandbox(f"c{i}")
    await node.delete_snapshot(f"s{i}")


async def sizes(node: Node) -> dict[str, float]:
    """Saved memory of a snapshot, and what an untouched one holds exclusively (MiB)."""
    await node.hibernate_sandbox(_SANDBOX)  # untouched from here on
    info = await node.snapshot_sandbox(_SANDBOX, "untouched")
    measured = await node.get_snapshot("untouched")
    await node.delete_snapshot("untouched")
    return {
        "snapshot saved memory": info.memory_bytes / 2**20,
        "untouched snapshot, exclusive disk": (measured.exclusive_bytes or 0) / 2**20,
    }


async def states(node: Node, runs: int) -> dict[str, list[float]]:
    """Save and load of one VM's state, sealed and plain, alternately (ms).

    The sandbox is hibernated; its VM is then launched ``incoming`` and driven here,
    under the node (no API saves a state to a file of one's choosing), as a wake does;
    each round one QEMU loads the sealed state and saves it plain, the next loads that
    and saves it sealed (QEMU launches are outside the timing).
    """
    results: dict[str, list[float]] = {name: [] for name in _STATES}
    await node.hibernate_sandbox(_SANDBOX)
    sandbox = node._registry.get(_SANDBOX)
    sealed, plain = sandbox.state_file, sandbox.volume / "vmstate.plain"
    launch = sandbox.launch
    try:
        for _ in range(runs):
            # QEMU saves a VM once (then it is "postmigrate"): each QEMU loads one file
            # and writes the other.
            vm = await launch(qemu_binary=node.config.qemu_binary, incoming=True)
            results["load sealed"].append(await _timed_ms(vm.load_state(sealed)))
            results["save plain"].append(await _timed_ms(_keyed(vm, None).save_state(plain)))
            await sandbox.teardown()
            vm = _keyed(await launch(qemu_binary=node.config.qemu_binary, incoming=True), None)
            results["load plain"].append(await _timed_ms(vm.load_state(plain)))
            keyed = _keyed(vm, sandbox.config.keys)
            results["save sealed"].append(await _timed_ms(keyed.save_state(sealed)))
            await sandbox.teardown()
        results["size sealed"] = [sealed.stat().st_size / 2**20]
        results["size plain"] = [plain.stat().st_size / 2**20]
    finally:
        await sandbox.teardown()
        plain.unlink(missing_ok=True)
    return results


def _keyed(vm: QemuVM, keys: NodeKeys | None) -> QemuVM:
    """The VM saving and loading states sealed under ``keys`` (None: plain, as before
    issue 18)."""
    vm.config = replace(vm.config, keys=keys)
    return vm


async def run(
    data_dir: Path, runs: int, user: str
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float]]:
    config = NodeConfig(data_dir=data_dir, pool_size_gib=16, boot_timeout_s=90.0)
    if user != "root":
        await become_node_user(config, node_user(user), lambda _msg: None)
    node = await Node.start(config)
    try:
        timed = await bench(node, runs)
        return timed, await states(node, runs), await sizes(node)
    finally:
        await node.shutdown(unmount_pool=True)


def _print_states(results: dict[str, list[float]]) -> None:
    for what in ("save", "load"):
        sealed = statistics.median(results[f"{what} sealed"])
        plain = statistics.median(results[f"{what} plain"])
        print(
            f"state {what}, median of {len(results[f'{what} sealed'])}:"
            f"  sealed {sealed:8.1f} ms  plain {plain:8.1f} ms  sealed/plain {sealed / plain:5.2f}x"
        )
    sealed, plain = results["size sealed"][0], results["size plain"][0]
    print(f"state size:  sealed {sealed:8.2f} MiB  plain {plain:8.2f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--user", default="space", help="the node agent's user")
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    runs = max(args.runs, 20)
    if args.data_dir is not None:  # the child: the node, its figures on stdout as JSON
        print(json.dumps(asyncio.run(run(args.data_dir, runs, args.user))))
        return
    with node_child(__file__, runs, args.user, "space-bench-lifecycle-") as (_, figures):
        results, sealing, sized = figures
    print(f"node agent's user: {args.user}")
    baseline = statistics.median(results["cold create (baseline)"])
    for name, values in results.items():
        ratio = baseline / statistics.median(values)
        print(f"{summary(name, values, 'ms')}  {ratio:8.1f}x faster than a cold create")
    for name, mib in sized.items():
        print(f"{name:<34} {mib:9.2f} MiB")
    _print_states(sealing)


if __name__ == "__main__":
    main()
