"""What asking the root broker costs the node agent (issue 18).

Every operation that needs root now goes through the broker: one request line over a
socket pair, checked against the scope, handled, answered. Timed here, against doing
the same work in the agent's own process (the way before the broker), side by side:

(a) the bare round trip: ``ReleaseVm`` of a VM that has no cgroup (a few rmdir calls
    that find nothing), and the same calls made directly;
(b) a namespace made, its ruleset opened and closed, and deleted (``ip``, ``nft``:
    what a create, a policy change and a delete of a sandbox with a NIC cost), and
    the same commands run directly;
(c) the round trip again with 16 requests in flight at once (a node busy with many
    sandboxes): the latency each sees.

Usage: `.venv/bin/python bench/bench_broker.py [--runs 200]` as root.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._stats import summary
from space.node.core.run import run
from space.node.network import netns
from space.node.privileged import RootBroker, Scope, start_broker
from space.node.privileged.requests import ReleaseVm

Times = list[float]


async def _round_trips(broker: RootBroker, runs: int) -> tuple[Times, Times]:
    via, direct = [], []
    bases = [Path(f"/sys/fs/cgroup/{c}/space/bench") for c in ("memory", "cpu", "pids")]
    for _ in range(runs):
        start = time.perf_counter()
        await broker.call(ReleaseVm(name="absent"))
        via.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        for base in bases:
            with contextlib.suppress(OSError):
                (base / "absent").rmdir()
        direct.append((time.perf_counter() - start) * 1000)
    return via, direct


async def _namespaces(broker: RootBroker, runs: int) -> tuple[Times, Times]:
    run_root = broker.scope.run_root
    via, direct = [], []
    for _ in range(runs):
        name = netns.node_prefix(run_root) + secrets.token_hex(3)
        start = time.perf_counter()
        await netns.create(run_root, name)
        await netns.set_open(run_root, name, True)
        await netns.set_open(run_root, name, False)
        await netns.delete(run_root, name)
        via.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        await _directly(name)
        direct.append((time.perf_counter() - start) * 1000)
    return via, direct


async def _directly(name: str) -> None:
    """What the broker runs for (b), run from this process."""
    await run("ip", "netns", "add", name)
    try:
        for command in (
            ("link", "set", "lo", "up"),
            ("tuntap", "add", "dev", netns.TAP, "mode", "tap"),
        ):
            await run("ip", "-n", name, *command)
        for is_open in (False, True, False):
            await run("nsenter", f"--net=/run/netns/{name}", "--", "nft", "-f", "-",
                      stdin=netns.ruleset(is_open))  # fmt: skip
    finally:
        await run("ip", "netns", "delete", name)


async def _in_flight(broker: RootBroker, runs: int, width: int) -> Times:
    times: Times = []

    async def one() -> None:
        start = time.perf_counter()
        await broker.call(ReleaseVm(name="absent"))
        times.append((time.perf_counter() - start) * 1000)

    for _ in range(max(1, runs // width)):
        async with asyncio.TaskGroup() as group:
            for _ in range(width):
                group.create_task(one())
    return times


async def main(runs: int) -> None:
    with tempfile.TemporaryDirectory(prefix="space-bench-broker-") as tmp:
        run_root = Path(tmp) / "run"
        run_root.mkdir()
        broker = await start_broker(Scope(run_root, (Path(tmp),)))
        try:
            via, direct = await _round_trips(broker, runs)
            print(summary("(a) round trip, via the broker", via, "ms"))
            print(summary("(a) the same work, directly", direct, "ms"))
            ns_runs = max(5, runs // 10)
            via, direct = await _namespaces(broker, ns_runs)
            print(summary("(b) namespace life, via the broker", via, "ms"))
            print(summary("(b) the same commands, directly", direct, "ms"))
            print(summary("(c) round trip, 16 in flight", await _in_flight(broker, runs, 16), "ms"))
        finally:
            await broker.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_broker.py must run as root")
    asyncio.run(main(args.runs))
