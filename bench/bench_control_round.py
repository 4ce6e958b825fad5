"""Benchmark of an idle control-plane replica's background round (space.control.background).

Every replica runs a round every ``--reaper-interval`` (5 s by default) whatever the
traffic: heartbeats, lost nodes, the reaper, drains, shipping, archives. This starts the
control app over a FakeNode (no VM; tests/unit/fakes.py) on SQLite and on a PostgreSQL
server of its own (tests/postgres.py), with a few and then many sandboxes recorded
(``--loads``), and times idle rounds two ways, interleaved: as they run now (a job lease
held with three quarters left is not written again) and with every lease renewed each
round (as before issue 21's last step; the held leases forgotten before each round).
Prints median and p90 of the CPU and wall time per round, the transactions and reads
per round, and the ratio now/before. Everything is removed at the end.

Usage: `.venv/bin/python bench/bench_control_round.py [--runs 200] [--loads 4,48]` as root
(PostgreSQL runs as its own user).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._stats import summary
from space.control.background import background_round
from space.control.deps import ControlContext
from space.control.store import Database
from tests.postgres import PostgresCluster
from tests.unit import fakes
from tests.unit.fakes import control_app

_WARM_ROUNDS = 10


def _counting(calls: Counter[str]) -> Callable[[], None]:
    """Count Database.call (a transaction) and read_call (none); returns the undo."""
    call, read_call = Database.call, Database.read_call

    def counted_call(self: Database, fn: Any) -> Any:
        calls["transactions"] += 1
        return call(self, fn)

    def counted_read(self: Database, fn: Any) -> Any:
        calls["reads"] += 1
        return read_call(self, fn)

    Database.call, Database.read_call = counted_call, counted_read  # type: ignore[method-assign]

    def undo() -> None:
        Database.call, Database.read_call = call, read_call  # type: ignore[method-assign]

    return undo


async def _rounds(url: str, load: int, runs: int) -> dict[str, list[float]]:
    fakes.DATABASE_URL = url
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-round-") as tmp:
        async with control_app(Path(tmp)) as h:
            key = h.key("bench")
            for _ in range(load):
                answer = await h.client.post("/v1/sandboxes", json={}, headers=key)
                assert answer.status_code == 201, answer.text
            ctx: ControlContext = h.app.state.ctx
            for _ in range(_WARM_ROUNDS):
                await background_round(ctx)
            for _ in range(runs):
                for way in ("now", "before"):
                    if way == "before":
                        ctx.held_jobs.clear()
                    calls: Counter[str] = Counter()
                    undo = _counting(calls)
                    cpu, wall = time.process_time(), time.perf_counter()
                    try:
                        await background_round(ctx)
                    finally:
                        undo()
                    results.setdefault(f"{way} cpu", []).append((time.process_time() - cpu) * 1000)
                    results.setdefault(f"{way} wall", []).append(
                        (time.perf_counter() - wall) * 1000
                    )
                    results.setdefault(f"{way} transactions", []).append(calls["transactions"])
                    results.setdefault(f"{way} reads", []).append(calls["reads"])
    return results


def _print(backend: str, load: int, results: dict[str, list[float]]) -> None:
    print(f"\n{backend}, {load} sandboxes recorded:")
    for way in ("before", "now"):
        print(summary(f"  {way}: round cpu", results[f"{way} cpu"], "ms"))
        print(summary(f"  {way}: round wall", results[f"{way} wall"], "ms"))
        per_round = {k: statistics.mean(results[f"{way} {k}"]) for k in ("transactions", "reads")}
        print(f"  {way}: per round {per_round['transactions']:.1f} transactions, "
              f"{per_round['reads']:.1f} reads without one")  # fmt: skip
    for figure in ("cpu", "wall"):
        ratio = statistics.median(results[f"now {figure}"]) / statistics.median(
            results[f"before {figure}"]
        )
        print(f"  now/before, {figure} median: {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--loads", default="4,48")
    args = parser.parse_args()
    loads = [int(n) for n in args.loads.split(",")]
    cluster = PostgresCluster()
    try:
        cluster.start()
        for load in loads:
            with tempfile.TemporaryDirectory(prefix="bench-round-db-") as tmp:
                url = f"sqlite:///{tmp}/space.db"
                _print("SQLite", load, asyncio.run(_rounds(url, load, args.runs)))
            with cluster.database() as url:
                _print("PostgreSQL", load, asyncio.run(_rounds(url, load, args.runs)))
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
