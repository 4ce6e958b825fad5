"""Benchmark of the skeleton's paths (issue 2), end to end through the SDK.

Starts its own embedded platform (`space serve` on loopback, a fresh data directory) and
prints median and p90 of:
- create -> first exec returns (cold boot path),
- exec round trip of `true`,
- 100 MiB upload and download throughput,
- host RSS of the VMM per idle 256 MiB sandbox,
plus the ratio of each median to its target. Usage: `.venv/bin/python bench/bench_sandbox.py
[--runs 20] [--parts create,exec,transfer]` as root. Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from space import Sandbox
from tests.integration.platform import qemu_pids, running_platform

MIB = 1024 * 1024


def summary(name: str, values: list[float], unit: str, target: str) -> str:
    ordered = sorted(values)
    p90 = ordered[max(0, round(0.9 * len(ordered)) - 1)]
    median = statistics.median(ordered)
    return (
        f"{name:<34} median {median:9.2f} {unit:<6} p90 {p90:9.2f} {unit:<6}"
        f" n={len(values):<3} target {target}"
    )


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def bench_create(url: str, key: str, data_dir: Path, runs: int) -> tuple[list[float], list[float]]:
    create_ms, rss = [], []
    for _ in range(runs):
        before = set(qemu_pids(data_dir))
        start = time.perf_counter()
        sbx = Sandbox.create(api_url=url, api_key=key, memory_mib=256)
        sbx.commands.run("true")
        create_ms.append((time.perf_counter() - start) * 1000)
        time.sleep(2)  # let the guest settle to idle before reading the VMM's RSS
        (pid,) = set(qemu_pids(data_dir)) - before
        rss.append(rss_mib(pid))
        sbx.kill()
    return create_ms, rss


def bench_exec(sbx: Sandbox, runs: int) -> list[float]:
    sbx.commands.run("true")
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        sbx.commands.run(["true"])
        times.append((time.perf_counter() - start) * 1000)
    return times


def bench_transfer(sbx: Sandbox, runs: int, work: Path) -> tuple[list[float], list[float]]:
    source = work / "up.bin"
    with source.open("wb") as f:
        for _ in range(100):
            f.write(os.urandom(MIB))
    up, down = [], []
    for _ in range(runs):
        start = time.perf_counter()
        sbx.files.upload_from(str(source), "/home/user/bench.bin")
        up.append(100 / (time.perf_counter() - start))
        start = time.perf_counter()
        sbx.files.download_to("/home/user/bench.bin", str(work / "down.bin"))
        down.append(100 / (time.perf_counter() - start))
    return up, down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument(
        "--parts",
        default="create,exec,transfer",
        help="which figures, comma-separated (exec alone: one sandbox, its round trips)",
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    lines = []
    with tempfile.TemporaryDirectory(prefix="space-bench-") as tmp:
        work = Path(tmp)
        with running_platform(work / "data") as platform:
            key = platform.create_key("bench")
            if "create" in parts:
                create_ms, rss = bench_create(platform.url, key, platform.data_dir, args.runs)
                lines.append(summary("create -> first exec", create_ms, "ms", "<= 6000 ms"))
                lines.append(summary("VMM RSS, idle 256 MiB sandbox", rss, "MiB", "<= 300 MiB"))
            sbx = Sandbox.create(api_url=platform.url, api_key=key, memory_mib=256)
            try:
                if "exec" in parts:
                    exec_ms = bench_exec(sbx, max(args.runs, 50))
                    lines.append(summary("exec round trip (true)", exec_ms, "ms", "<= 25 ms"))
                if "transfer" in parts:
                    up, down = bench_transfer(sbx, args.runs, work)
                    lines.append(summary("upload 100 MiB", up, "MiB/s", ">= 50 MiB/s"))
                    lines.append(summary("download 100 MiB", down, "MiB/s", ">= 50 MiB/s"))
            finally:
                sbx.kill()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
