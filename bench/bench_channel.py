"""Benchmark of the guest channel alone: a Node driven directly, no HTTP in between.

Boots one 256 MiB sandbox on a private data directory and prints medians of:
- 100 MiB upload (write_file) and download (read_file) throughput,
- exec round trip of `true`, `stat` round trip, PING round trip.
Usage: `.venv/bin/python bench/bench_channel.py [--runs 5] [--mib 100]` as root. Everything
it starts (VM, pool mount, loop device) is torn down at the end, even on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from space.node.agent import Node
from space.node.api import ExecExited, ExecRequest, SandboxSpec
from space.node.core.config import NodeConfig
from tests.integration.conftest import release_data_dir

MIB = 1024 * 1024
CHUNK = 1 * MIB
SANDBOX = "bench-channel"


async def _chunks(blob: bytes) -> AsyncIterator[bytes]:
    view = memoryview(blob)
    for start in range(0, len(view), CHUNK):
        yield bytes(view[start : start + CHUNK])


async def upload(node: Node, blob: bytes) -> float:
    start = time.perf_counter()
    await node.write_file(SANDBOX, "/home/user/big.bin", _chunks(blob))
    return time.perf_counter() - start


async def download(node: Node, expected: bytes) -> float:
    start = time.perf_counter()
    reader = await node.read_file(SANDBOX, "/home/user/big.bin")
    parts = [chunk async for chunk in reader]
    elapsed = time.perf_counter() - start
    if b"".join(parts) != expected:
        raise SystemExit("download differs from upload")
    return elapsed


async def exec_true(node: Node) -> float:
    start = time.perf_counter()
    stream = await node.exec(SANDBOX, ExecRequest(argv=["true"]))
    events = [event async for event in stream]
    elapsed = time.perf_counter() - start
    if not isinstance(events[-1], ExecExited) or events[-1].exit_code != 0:
        raise SystemExit(f"true failed: {events}")
    return elapsed


async def stat_home(node: Node) -> float:
    start = time.perf_counter()
    await node.stat(SANDBOX, "/home/user")
    return time.perf_counter() - start


def line(name: str, values: list[float], unit: str) -> str:
    return f"{name:<22} median {statistics.median(values):9.2f} {unit:<6} min {min(values):9.2f}"


async def bench(data_dir: Path, runs: int, mib: int) -> None:
    node = await Node.start(NodeConfig(data_dir=data_dir, pool_size_gib=8, boot_timeout_s=120.0))
    try:
        await node.create_sandbox(SandboxSpec(sandbox_id=SANDBOX, memory_mib=256))
        blob = os.urandom(mib * MIB)
        ups, downs = [], []
        for _ in range(runs):
            ups.append(mib / await upload(node, blob))
            downs.append(mib / await download(node, blob))
        for _ in range(3):  # warm up the exec path (page cache of `true`)
            await exec_true(node)
        execs = [await exec_true(node) * 1000 for _ in range(runs * 10)]
        stats = [await stat_home(node) * 1000 for _ in range(runs * 10)]
        channel = await node.guest.channel(SANDBOX)  # a benchmark may peek
        pings = [await channel.ping() * 1000 for _ in range(runs * 10)]
        print(line(f"upload {mib} MiB", ups, "MiB/s"))
        print(line(f"download {mib} MiB", downs, "MiB/s"))
        print(line("exec true", execs, "ms"))
        print(line("stat", stats, "ms"))
        print(line("ping", pings, "ms"))
    finally:
        await node.shutdown(unmount_pool=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mib", type=int, default=100)
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="bench-channel-"))
    try:
        asyncio.run(bench(data_dir, args.runs, args.mib))
    finally:
        leaked = release_data_dir(data_dir)
        if leaked:
            print(f"cleaned up leftovers: {leaked}", file=sys.stderr)
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
