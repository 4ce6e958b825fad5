"""Benchmark of a TCG guest's CPU model: QEMU's ``max`` against ``TCG_CPU`` (``max``
without the fast-string features, space.node.vmm.qemu), side by side on one node.

Where the CPU claims ERMS/FSRM, the guest's kernel and glibc copy and clear memory with
``rep movsb``/``rep stosb``, which TCG emulates a byte at a time. The node starts on a
fresh data directory; two 256 MiB sandboxes are cold-booted, one on each CPU (a disk a
little larger than the ready state's, so neither wakes from it), ``--boots`` times in
turn for the boot figure; then, alternately on the two, each workload runs ``--runs``
times and the bench prints medians, p90s and the ratio of ``max`` to ``TCG_CPU``, and
the QEMU process's host CPU per run (schedstat, all its threads). ``--loads`` repeats
the workloads with that many idle sandboxes beside them (from the ready state, on
``TCG_CPU``): the figure with a few sandboxes on the node and with dozens. Everything
is removed at the end, also on failure.

Usage: `.venv/bin/python bench/bench_guest_cpu.py [--runs 15] [--boots 3]
[--loads 0,16] [--user space]` as root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._host import process_cpu_ms
from bench._node_child import node_child
from bench._stats import summary
from space.node.agent import Node
from space.node.agent.node_user import become_node_user, node_user
from space.node.api import ExecExited, ExecRequest, SandboxSpec
from space.node.core.config import NodeConfig
from space.node.core.template import READY_SHAPE
from space.node.vmm import qemu

_MODELS = {"max": "max", "TCG_CPU": qemu.TCG_CPU}
_WORKLOADS = {
    "exec true": "true",
    "python3 -c pass": "python3 -c pass",
    "python3 import asyncio, json": "python3 -c 'import asyncio, json'",
    "10 spawns of /bin/true": "for i in 1 2 3 4 5 6 7 8 9 10; do /bin/true; done",
    "write 64 MiB": "dd if=/dev/zero of=/tmp/z bs=1M count=64 status=none",
    "interpreted loop (no copies)": "python3 -c 'sum(range(2000000))'",
}


async def _run(node: Node, sandbox_id: str, cmd: str) -> None:
    stream = await node.exec(sandbox_id, ExecRequest(cmd=cmd))
    exits = [event async for event in stream if isinstance(event, ExecExited)]
    if [e.exit_code for e in exits] != [0]:
        raise RuntimeError(f"{cmd!r} did not exit 0: {exits}")


async def _boot(node: Node, model: str) -> tuple[float, int]:
    """Cold-boot a sandbox named ``model`` on that CPU; the time until it answers, and
    its QEMU's pid."""
    qemu.TCG_CPU = _MODELS[model]  # read by build_command at launch
    try:
        start = time.perf_counter()
        status = await node.create_sandbox(
            SandboxSpec(model, memory_mib=256, disk_mib=READY_SHAPE.disk_mib + 256)
        )
        await _run(node, model, "true")
        elapsed = (time.perf_counter() - start) * 1000
    finally:
        qemu.TCG_CPU = _MODELS["TCG_CPU"]
    assert status.vmm_pid is not None
    return elapsed, status.vmm_pid


async def _workloads(
    node: Node, pids: dict[str, int], runs: int, load: int
) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {}
    for _ in range(runs):
        for name, cmd in _WORKLOADS.items():
            for model, pid in pids.items():
                cpu = process_cpu_ms(pid)
                start = time.perf_counter()
                await _run(node, model, cmd)
                wall = (time.perf_counter() - start) * 1000
                results.setdefault(f"{load}|{model}|{name}", []).append(wall)
                results.setdefault(f"{load}|{model}|{name}|cpu", []).append(
                    process_cpu_ms(pid) - cpu
                )
    return results


async def run(
    data_dir: Path, runs: int, boots: int, loads: list[int], user: str
) -> dict[str, list[float]]:
    config = NodeConfig(data_dir=data_dir, pool_size_gib=24, boot_timeout_s=120.0)
    if user != "root":
        await become_node_user(config, node_user(user), lambda _msg: None)
    node = await Node.start(config)
    if node.accelerator != "tcg":
        raise SystemExit("this bench compares TCG CPU models: the node runs KVM")
    results: dict[str, list[float]] = {}
    try:
        for _ in range(boots):
            for model in _MODELS:
                elapsed, _pid = await _boot(node, model)
                results.setdefault(f"boot|{model}", []).append(elapsed)
                await node.delete_sandbox(model)
        pids = {model: (await _boot(node, model))[1] for model in _MODELS}
        idle = 0
        for load in loads:
            while idle < load:
                await node.create_sandbox(SandboxSpec(f"idle-{idle}", memory_mib=256))
                idle += 1
            results |= await _workloads(node, pids, runs, load)
        return results
    finally:
        await node.shutdown(unmount_pool=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--boots", type=int, default=3)
    parser.add_argument("--loads", default="0,16", help="idle sandboxes beside, per pass")
    parser.add_argument("--user", default="space", help="the node agent's user")
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    loads = sorted({int(n) for n in args.loads.split(",")})
    if args.data_dir is not None:  # the child: the node, its figures on stdout as JSON
        print(json.dumps(asyncio.run(run(args.data_dir, args.runs, args.boots, loads, args.user))))
        return
    extra = [f"--boots={args.boots}", f"--loads={args.loads}"]
    with node_child(__file__, args.runs, args.user, "space-bench-cpu-", extra) as (_, results):
        pass
    print(f"TCG_CPU = {qemu.TCG_CPU}")
    _compare(results, "cold boot to first exec", "boot|{model}")
    for load in loads:
        print(f"-- {load} idle sandboxes beside")
        for name in _WORKLOADS:
            _compare(results, name, f"{load}|{{model}}|{name}")
            _compare(results, "  host CPU of its QEMU", f"{load}|{{model}}|{name}|cpu")


def _compare(results: dict[str, list[float]], name: str, key: str) -> None:
    """Each model's line for ``key`` (with ``{model}`` in it), then the ratio."""
    medians = {}
    for model in _MODELS:
        values = results[key.format(model=model)]
        print(summary(f"{name} [{model}]", values, "ms"))
        medians[model] = statistics.median(values)
    print(f"{'':<34} max / TCG_CPU: {medians['max'] / medians['TCG_CPU']:.2f}x")


if __name__ == "__main__":
    main()
