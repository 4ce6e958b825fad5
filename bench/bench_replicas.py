"""Benchmark of the control plane replicated on PostgreSQL against the embedded
platform on SQLite (issue 19; target: create and exec p50 within 1.2x).

Side by side on this machine: (a) `space serve` (control plane and node in one process,
SQLite), and (b) two `space control` replicas on a PostgreSQL server of their own with
one `space node` in a network namespace, as tests/integration/hosts.py runs them (the
node reached over a bridge, the replicas over its host end). Each round creates a
default sandbox on each (through the SDK, until the create returned: from the template's
ready state) and runs ``true`` in it (until it exited), then deletes it (not timed),
alternating (a) and (b); on (b) the create goes to one replica and the exec to the
other. The same rounds run with a few sandboxes idling on each node, then with more
(``--loads``). Prints median and p90 of each and the ratio (b)/(a). Everything is
removed at the end, also on failure.

Usage: `.venv/bin/python bench/bench_replicas.py [--runs 15] [--loads 2,12]` as root.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._platform import Api, embedded_platform, say
from bench._stats import percentile
from space import Sandbox
from space.limits import QUOTAS
from tests.integration.hosts import Cluster, cluster
from tests.integration.platform import SPACE
from tests.ports import free_port
from tests.postgres import PostgresCluster

_TENANT = "bench"
_POOL_GIB = 24


def _round(create_url: str, exec_url: str, key: str) -> tuple[float, float]:
    start = time.perf_counter()
    made = Sandbox.create(api_url=create_url, api_key=key)
    create_ms = (time.perf_counter() - start) * 1000
    there = made
    if exec_url != create_url:
        there = Sandbox.connect(made.sandbox_id, api_url=exec_url, api_key=key)
    try:
        start = time.perf_counter()
        result = there.commands.run("true")
        exec_ms = (time.perf_counter() - start) * 1000
        assert result.exit_code == 0, result
    finally:
        made.kill()
        for sandbox in {made, there}:
            sandbox.close()
    return create_ms, exec_ms


def _lift_quotas(database_url: str, data_dir: Path) -> None:
    options = [arg for quota in QUOTAS for arg in (quota.option, str(1 << 40))]
    subprocess.run(
        [*SPACE, "quota", "set", "--tenant", _TENANT, *options, "--database", database_url,
         "--data-dir", str(data_dir)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip


def _fill(url: str, key: str, count: int, held: dict[str, list[Sandbox]]) -> None:
    """Sandboxes idling on ``url``'s node until it has ``count`` of them (from this bench)."""
    mine = held.setdefault(url, [])
    while len(mine) < count:
        mine.append(Sandbox.create(api_url=url, api_key=key, timeout_s=None))


def bench(embedded: Api, hosts: Cluster, key: str, runs: int, loads: list[int]) -> None:
    replicas = [replica.url for replica in hosts.replicas]
    held: dict[str, list[Sandbox]] = {}
    try:
        for load in loads:
            _fill(embedded.url, embedded.key, load, held)
            _fill(replicas[0], key, load, held)
            say(f"{load} sandboxes idle on each node; {runs} rounds")
            figures: dict[str, list[float]] = {}
            for i in range(runs):
                for name, (create_url, exec_url, api_key) in (
                    ("embedded, SQLite", (embedded.url, embedded.url, embedded.key)),
                    ("2 replicas, PostgreSQL", (replicas[i % 2], replicas[(i + 1) % 2], key)),
                ):
                    create_ms, exec_ms = _round(create_url, exec_url, api_key)
                    figures.setdefault(f"create/{name}", []).append(create_ms)
                    figures.setdefault(f"exec/{name}", []).append(exec_ms)
            _print(load, figures)
    finally:
        for sandbox in (s for sandboxes in held.values() for s in sandboxes):
            sandbox.kill()
            sandbox.close()


def _print(load: int, figures: dict[str, list[float]]) -> None:
    for operation in ("create", "exec"):
        base = figures[f"{operation}/embedded, SQLite"]
        replicated = figures[f"{operation}/2 replicas, PostgreSQL"]
        ratio = statistics.median(replicated) / statistics.median(base)
        print(
            f"{load:3d} idle per node  {operation:<6}  embedded SQLite median "
            f"{statistics.median(base):8.1f} ms (p90 {percentile(base, 0.9):8.1f})  "
            f"2 replicas PostgreSQL median {statistics.median(replicated):8.1f} ms "
            f"(p90 {percentile(replicated, 0.9):8.1f})  ratio {ratio:5.2f}x",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--loads", default="2,12", help="idle sandboxes per node, by phase")
    args = parser.parse_args()
    loads = [int(n) for n in args.loads.split(",")]
    postgres = PostgresCluster()
    with tempfile.TemporaryDirectory(prefix="space-bench-replicas-") as tmp:
        root = Path(tmp)
        try:
            postgres.start()
            with (
                postgres.database() as url,
                embedded_platform(root / "embedded", ["--pool-size-gib", str(_POOL_GIB)]) as api,
                cluster(
                    root / "hosts",
                    url,
                    nodes=1,
                    replicas=2,
                    ports=[free_port(), free_port()],
                    pool_size_gib=_POOL_GIB,
                ) as hosts,  # fmt: skip
            ):
                key = hosts.create_key(_TENANT)
                _lift_quotas(url, hosts.replicas[0].data_dir)
                say("both platforms ready")
                bench(api, hosts, key, args.runs, loads)
        finally:
            postgres.stop()


if __name__ == "__main__":
    main()
