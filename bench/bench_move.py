"""Benchmark of moves of hibernated sandboxes between two nodes on this host (issue 19).

Starts two Nodes (tests/integration/moves_nodes.py: each its own data dir and
loop-file btrfs pool, one node key, the source's API on loopback) and, ``--runs``
times each, moves a hibernated 256 MiB sandbox (a file written, a background process
running) from source to target: with a full stream (the target offered no parent)
and incrementally (against the template subvolume the sandbox came from, shipped to
the target once beforehand). A move is timed from ``export_sandbox`` on the source
through ``import_sandbox`` on the target to ``finish_export`` (the source's copy
deleted); the sandbox's creation and hibernation are not. Prints median and p90 of
each and the bytes each stream carried, and the wake on the target of the last one.
Target (issue 19): incremental p50 <= 2 s. Everything is removed at the end, also on
failure. Usage: `.venv/bin/python bench/bench_move.py [--runs 5]` as root.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from bench._stats import summary
from space.node.api import ExecRequest, SandboxSpec
from tests.integration.moves_nodes import TwoNodes, ship_origin, two_nodes

_COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.2; done"


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


def hibernated_sandbox(nodes: TwoNodes, sandbox_id: str) -> None:
    source = nodes.source
    nodes.run(source.create_sandbox(SandboxSpec(sandbox_id, memory_mib=256)))
    nodes.run(source.write_file(sandbox_id, "/home/user/f", _one(b"x" * 65536)))
    bg = nodes.run(source.exec(sandbox_id, ExecRequest(cmd=_COUNTER, background=True)))
    nodes.run(bg.aclose())
    time.sleep(0.5)
    nodes.run(source.hibernate_sandbox(sandbox_id))


def _move(nodes: TwoNodes, sandbox_id: str, *, incremental: bool) -> tuple[float, int]:
    """Seconds and stream bytes of one move of the hibernated ``sandbox_id``."""
    start = time.monotonic()
    ticket = nodes.run(nodes.source.export_sandbox(sandbox_id))
    if not incremental:
        ticket = dataclasses.replace(ticket, parents=[])
    result = nodes.run(nodes.target.import_sandbox(ticket, nodes.source_url))
    nodes.run(nodes.source.finish_export(sandbox_id, ticket.ticket, moved=True))
    elapsed = time.monotonic() - start
    assert (result.parent is not None) == incremental, result
    return elapsed, result.stream_bytes


def _series(nodes: TwoNodes, runs: int, *, incremental: bool) -> tuple[list[float], list[int]]:
    times, sizes = [], []
    kind = "incr" if incremental else "full"
    for i in range(runs):
        sid = f"bench-move-{kind}-{i}"
        hibernated_sandbox(nodes, sid)
        if incremental and i == 0:
            nodes.run(ship_origin(nodes.source, nodes.target, sid))
        seconds, size = _move(nodes, sid, incremental=incremental)
        times.append(seconds)
        sizes.append(size)
        if i < runs - 1:
            nodes.run(nodes.target.delete_sandbox(sid))
    return times, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-move-") as tmp, two_nodes(Path(tmp)) as nodes:
        full_s, full_bytes = _series(nodes, args.runs, incremental=False)
        incr_s, incr_bytes = _series(nodes, args.runs, incremental=True)
        last = f"bench-move-incr-{args.runs - 1}"
        start = time.monotonic()
        nodes.run(nodes.target.resume_sandbox(last))
        wake_s = time.monotonic() - start
        print(summary("move, full stream", full_s, "s"))
        print(summary("move, incremental", incr_s, "s"))
        print(f"{'stream bytes, full':<34} median {statistics.median(full_bytes):,.0f}")
        print(f"{'stream bytes, incremental':<34} median {statistics.median(incr_bytes):,.0f}")
        print(f"{'wake on the target (last move)':<34} {wake_s:.2f} s")
        target_met = statistics.median(incr_s) <= 2.0
        print(f"incremental p50 <= 2 s: {'yes' if target_met else 'NO'}")
        for sid in [s.sandbox_id for s in nodes.run(nodes.target.list_sandboxes())]:
            nodes.run(nodes.target.delete_sandbox(sid))
    sys.exit(0)


if __name__ == "__main__":
    main()
