"""Benchmark of sandbox creation paths side by side (issue 4).

One Node (as tests/integration starts it) on a fresh data directory; the same template
and shape (1 vCPU, 256 MiB, 2 GiB disk) created again and again, each create timed until
the first exec (``true``) in it returned, then deleted (not timed). Paths:

(a) cold: a full copy of the template's files into a new subvolume + cold boot;
(b) a copy-on-write clone (btrfs snapshot) + cold boot;
(c) a copy-on-write clone of the template's ready state + restore of its memory;
(d) a warm-pool hit: a VM already woken from the ready state and paused, handed over.

Runs are interleaved (a, b, c, d, a, b, ...) so drift of the machine hits every path
alike; after each (d) the pool refills before the next create is timed, so no timed
create shares the machine with a refill. Prints median and p90 of each and its ratio
to (a). Everything is removed at the end, also on failure.
Usage: `.venv/bin/python bench/bench_create.py [--runs 30]` as root.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._stats import summary
from space.node._run import run as run_command
from space.node.config import NodeConfig
from space.node.interface import ExecExited, ExecRequest, SandboxSpec
from space.node.service import Node
from space.node.storage.btrfs import BtrfsPool, TemplateVolume, grow_image
from tests.integration.conftest import release_data_dir

PATHS = (
    "(a) full copy + cold boot",
    "(b) CoW clone + cold boot",
    "(c) CoW clone + ready state",
    "(d) warm pool hit",
)


async def full_copy_volume(
    pool: BtrfsPool, sandbox_id: str, template: TemplateVolume, *, disk_mib: int
) -> Path:
    """What creation costs without copy-on-write: every byte of the template copied."""
    path = pool.sandbox_path(sandbox_id)
    await run_command("btrfs", "subvolume", "create", str(path))
    for name in ("kernel", "initrd", "rootfs.img"):
        source = template.path / name
        await run_command("cp", "--reflink=never", str(source), str(path / name), timeout_s=300)
    await grow_image(path / "rootfs.img", disk_mib)
    return path


async def _first_exec(node: Node, sandbox_id: str) -> None:
    stream = await node.exec(sandbox_id, ExecRequest(argv=["true"]))
    exits = [e for e in [event async for event in stream] if isinstance(e, ExecExited)]
    if [e.exit_code for e in exits] != [0]:
        raise RuntimeError(f"true did not exit 0: {exits}")


async def _timed_create(node: Node, sandbox_id: str) -> float:
    start = time.perf_counter()
    await node.create_sandbox(SandboxSpec(sandbox_id, memory_mib=256))
    await _first_exec(node, sandbox_id)
    elapsed = (time.perf_counter() - start) * 1000
    await node.delete_sandbox(sandbox_id)
    return elapsed


def _path_setters(node: Node) -> list[Callable[[], None]]:
    """One function per path that switches the node to it."""
    template = node._templates["base"]
    cold = replace(template, ready=None)
    cow = node.pool.create_sandbox_volume
    warm = node._pools.pop("base")

    async def copying(sandbox_id: str, template: TemplateVolume, *, disk_mib: int) -> Path:
        return await full_copy_volume(node.pool, sandbox_id, template, disk_mib=disk_mib)

    def full_copy() -> None:
        node._templates["base"] = cold
        node.pool.create_sandbox_volume = copying  # type: ignore[method-assign]

    def clone() -> None:
        node._templates["base"] = cold
        node.pool.create_sandbox_volume = cow  # type: ignore[method-assign]

    def ready() -> None:
        node._templates["base"] = template
        node.pool.create_sandbox_volume = cow  # type: ignore[method-assign]
        node._pools.pop("base", None)

    def pooled() -> None:
        ready()
        node._pools["base"] = warm

    return [full_copy, clone, ready, pooled]


async def _pool_full(node: Node, timeout_s: float = 300.0) -> None:
    async with asyncio.timeout(timeout_s):
        while True:  # the pool has no event to wait on: it is polled, as a client would
            if any(p.size >= p.target > 0 for p in (await node.info()).pools):
                return
            await asyncio.sleep(0.1)


async def bench(node: Node, runs: int) -> dict[str, list[float]]:
    if node._templates["base"].ready is None:
        raise RuntimeError("the node made no ready state for the base template")
    results: dict[str, list[float]] = {name: [] for name in PATHS}
    setters = _path_setters(node)
    for i in range(runs):
        for name, use in zip(PATHS, setters, strict=True):
            use()
            if name == PATHS[3]:
                await _pool_full(node)
            results[name].append(await _timed_create(node, f"bench-{i}"))
        await _pool_full(node)
    setters[3]()
    return results


async def run(data_dir: Path, runs: int) -> dict[str, list[float]]:
    config = NodeConfig(
        data_dir=data_dir, pool_size_gib=8, boot_timeout_s=90.0, warm_pool_min=1, warm_pool_max=1
    )
    node = await Node.start(config)
    try:
        return await bench(node, runs)
    finally:
        await node.shutdown(unmount_pool=True)


def report(results: dict[str, list[float]], say: Callable[[str], None] = print) -> None:
    baseline = statistics.median(results[PATHS[0]])
    for name, values in results.items():
        ratio = baseline / statistics.median(values)
        say(f"{summary(name, values, 'ms')}  {ratio:6.1f}x vs (a)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="space-bench-create-") as tmp:
        data_dir = Path(tmp) / "data"
        try:
            results = asyncio.run(run(data_dir, args.runs))
        finally:
            leaked = release_data_dir(data_dir)
            if leaked:
                print(f"cleaned up leftovers: {leaked}", file=sys.stderr)
    report(results)


if __name__ == "__main__":
    main()
