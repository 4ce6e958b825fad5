"""Benchmark of gVisor sandboxes on the node (issue 21), beside their floor.

Starts a Node (as ``space serve`` runs it: the root broker, then the node agent as
``--user``, ``space`` by default) on a fresh data directory with a loop-file btrfs pool
and its ready states (a VM's, made first under TCG: tens of seconds, and gVisor's),
``auto`` meaning gVisor and a warm pool of one, and times through
the node's own calls:
- a cold create (clone of the tree, namespace, runsc, spaced's hello; a disk size
  the pool does not hold) and its first exec of ``true``, together and the create alone;
- a warm-pool hit (a started, paused gVisor sandbox handed over: records, runsc resume,
  the fresh identity) and its first exec of ``true``, together and alone;
- a create from the template's gVisor ready state (its pool taken out: a clone of the
  checkpoint and its tree, runsc restore, the fresh identity) and its first exec;
- exec of ``true`` on a running gVisor sandbox (the guest channel round trip);
- delete (runsc gone, volume, namespace, cgroup removed);
- with an egress policy open: hibernate, wake with its first exec, and a fork of one
  child with the child's first exec (checkpoints of gVisor's own network stack);
and the floor beside them: ``runsc do /bin/true`` (ptrace platform, no network), a
sandbox that runs one process and exits, with each figure's ratio to it. Everything is
removed at the end, also on failure. Usage, as root:
``.venv/bin/python bench/bench_gvisor.py [--runs 20] [--user space]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._node_child import node_child
from bench._stats import summary
from space.node.agent import Node
from space.node.agent.node_user import become_node_user, node_user
from space.node.api import ExecExited, ExecRequest, SandboxSpec
from space.node.core.config import NodeConfig

_FLOOR = "runsc do true (floor)"
#: Cold creates ask for this disk, not the template's: no pool sandbox has it.
_COLD_DISK_MIB = 3072
#: An egress policy that opens the sandbox's network (nothing is fetched).
_EGRESS: dict[str, object] = {"allow": [{"domain": "example.test", "ports": [443]}]}


async def _pool_filled(node: Node, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (await node.info()).pools[0].size:
        if time.monotonic() > deadline:
            raise RuntimeError("the warm pool did not fill")
        await asyncio.sleep(0.05)


async def _exec_true(node: Node, sandbox_id: str) -> None:
    async for event in await node.exec(sandbox_id, ExecRequest(argv=["true"])):
        if isinstance(event, ExecExited) and event.exit_code != 0:
            raise RuntimeError(f"true exited with {event.exit_code}")


async def bench(node: Node, runs: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {}

    def add(name: str, start: float) -> float:
        now = time.perf_counter()
        results.setdefault(name, []).append((now - start) * 1000)
        return now

    async def create_then_exec(spec: SandboxSpec, create: str, first_exec: str) -> None:
        """Time a create (``create``), its first exec of ``true`` (``first_exec``) and
        the two together."""
        start = time.perf_counter()
        await node.create_sandbox(spec)
        created = add(create, start)
        await _exec_true(node, spec.sandbox_id)
        add(f"{create} + first exec true", start)
        add(first_exec, created)

    await _pool_filled(node)  # its first sandbox made the base's tree (docs: 2.5 s)
    for i in range(runs):
        sid = f"gv-{i}"
        cold = SandboxSpec(sid, guest="gvisor", disk_mib=_COLD_DISK_MIB)
        await create_then_exec(cold, "cold create", "first exec true")
        start = time.perf_counter()
        await node.delete_sandbox(sid)
        add("delete", start)
    for i in range(runs):
        sid = f"gp-{i}"
        await _pool_filled(node)
        await create_then_exec(SandboxSpec(sid), "pool-hit create", "pool-hit first exec true")
        await node.delete_sandbox(sid)
    (pool,) = (await node.info()).pools
    if pool.hits != runs:
        raise RuntimeError(f"{runs - pool.hits} creates missed the warm pool")
    # The template's gVisor ready state, its pool taken out so that nothing else serves.
    base = node.templates.catalog.resolve("base")
    if base.gvisor_ready is None:
        raise RuntimeError("the base template has no gVisor ready state")
    warm = node.pools.by_digest.pop(base.digest)
    for i in range(runs):
        sid = f"gr-{i}"
        ready = SandboxSpec(sid, guest="gvisor")
        await create_then_exec(ready, "ready-state create", "ready-state first exec true")
        await node.delete_sandbox(sid)
    node.pools.by_digest[base.digest] = warm
    await node.create_sandbox(SandboxSpec("gv-exec", guest="gvisor"))
    await _exec_true(node, "gv-exec")
    for _ in range(runs * 5):
        start = time.perf_counter()
        await _exec_true(node, "gv-exec")
        add("exec true (running)", start)
    await node.delete_sandbox("gv-exec")
    # Saved memory with egress open: gVisor's own network stack goes through a
    # checkpoint (the host's could not).
    await node.create_sandbox(SandboxSpec("gv-net", guest="gvisor", egress=_EGRESS))
    for i in range(runs):
        start = time.perf_counter()
        await node.hibernate_sandbox("gv-net")
        add("hibernate (egress open)", start)
        start = time.perf_counter()
        await node.resume_sandbox("gv-net")
        await _exec_true(node, "gv-net")
        add("wake + first exec true (egress open)", start)
        start = time.perf_counter()
        await node.fork_sandbox("gv-net", [f"gv-child-{i}"])
        await _exec_true(node, f"gv-child-{i}")
        add("fork of one + its first exec (egress open)", start)
        await node.delete_sandbox(f"gv-child-{i}")
    await node.delete_sandbox("gv-net")
    return results


async def run(data_dir: Path, runs: int, user: str) -> dict[str, list[float]]:
    config = NodeConfig(
        data_dir=data_dir,
        pool_size_gib=16,
        guest_without_kvm="gvisor",
        warm_pool_min=1,
        warm_pool_max=1,
    )
    if user != "root":
        await become_node_user(config, node_user(user), lambda _msg: None)
    node = await Node.start(config)
    try:
        return await bench(node, runs)
    finally:
        await node.shutdown(unmount_pool=True)


def floor(runs: int, state: Path) -> list[float]:
    """``runsc do /bin/true`` wall times in ms: a whole sandbox for one process."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(
            ["runsc", f"--root={state}", "--platform=ptrace", "--network=none", "do", "/bin/true"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--user", default="space", help="the node agent's user")
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    runs = max(args.runs, 5)
    if args.data_dir is not None:  # the child: the node, its figures on stdout as JSON
        print(json.dumps(asyncio.run(run(args.data_dir, runs, args.user))))
        return
    with node_child(__file__, runs, args.user, "space-bench-gvisor-") as (tmp, figures):
        results: dict[str, list[float]] = {_FLOOR: floor(runs, tmp / "runsc")}
    results |= figures
    print(f"node agent's user: {args.user}")
    base = statistics.median(results[_FLOOR])
    for name, values in results.items():
        ratio = statistics.median(values) / base
        print(f"{summary(name, values, 'ms')}  {ratio:6.2f}x the floor")


if __name__ == "__main__":
    main()
