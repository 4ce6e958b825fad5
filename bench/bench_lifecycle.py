"""Benchmark of pause and resume on the node (lifecycle issue, first step).

Starts a Node directly (as tests/integration does) on a fresh data directory with a
loop-file btrfs pool, boots one 256 MiB sandbox and prints median and p90 of:
- pause (QMP ``stop`` + state persisted), with a background process running,
- resume (QMP ``cont`` + state persisted),
- exec of ``true`` on a paused sandbox (auto-resume included) next to one on a running
  sandbox.
Everything (VM, pool mount, loop device) is removed at the end, also on failure.
Usage: `.venv/bin/python bench/bench_lifecycle.py [--runs 20]` as root.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from space.node.config import NodeConfig
from space.node.interface import ExecExited, ExecRequest, SandboxSpec
from space.node.service import Node
from tests.integration.conftest import release_data_dir

_SANDBOX = "bench-lifecycle"
_BUSY = "while true; do echo x > /tmp/busy; sleep 0.1; done"


def summary(name: str, values: list[float], unit: str) -> str:
    ordered = sorted(values)
    p90 = ordered[max(0, round(0.9 * len(ordered)) - 1)]
    return (
        f"{name:<34} median {statistics.median(ordered):9.2f} {unit:<3}"
        f" p90 {p90:9.2f} {unit:<3} n={len(values)}"
    )


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
    await node.create_sandbox(SandboxSpec(_SANDBOX, memory_mib=256))
    busy = await node.exec(_SANDBOX, ExecRequest(cmd=_BUSY, background=True))
    await busy.aclose()
    await _exec_true(node)
    results: dict[str, list[float]] = {
        "pause": [],
        "resume": [],
        "exec true (running)": [],
        "exec true (paused, auto-resume)": [],
    }
    for _ in range(runs):
        results["pause"].append(await _timed_ms(node.pause_sandbox(_SANDBOX)))
        results["resume"].append(await _timed_ms(node.resume_sandbox(_SANDBOX)))
        results["exec true (running)"].append(await _timed_ms(_exec_true(node)))
        await node.pause_sandbox(_SANDBOX)
        results["exec true (paused, auto-resume)"].append(await _timed_ms(_exec_true(node)))
    return results


async def run(data_dir: Path, runs: int) -> dict[str, list[float]]:
    node = await Node.start(NodeConfig(data_dir=data_dir, pool_size_gib=4, boot_timeout_s=90.0))
    try:
        return await bench(node, runs)
    finally:
        await node.shutdown(unmount_pool=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="space-bench-lifecycle-") as tmp:
        data_dir = Path(tmp) / "data"
        try:
            results = asyncio.run(run(data_dir, max(args.runs, 20)))
        finally:
            leaked = release_data_dir(data_dir)
            if leaked:
                print(f"cleaned up leftovers: {leaked}", file=sys.stderr)
    for name, values in results.items():
        print(summary(name, values, "ms"))


if __name__ == "__main__":
    main()
