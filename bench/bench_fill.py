"""Benchmark of a node as it fills (issue 15): exec throughput, writeback, CPU and memory.

Starts this checkout's embedded platform (`space serve` in a subprocess, a fresh data
directory under /tmp) and, for each size N of ``--sizes`` (default 4 and 48), through
the SDK:

1. with no sandbox on the node: MemAvailable;
2. creates N default sandboxes (``--create-workers`` at a time), runs one ``echo ok``
   in each (a woken VM translates its guest's code anew on first use: paid once, kept
   out of the timed window), syncs, waits ``--settle`` seconds; MemAvailable again:
   host memory per idle sandbox is the difference divided by N; then a ``--idle``
   second window: the CPU time of the sandboxes' VMMs in it, divided by N;
3. for ``--seconds``, ``--threads`` threads run ``echo ok`` (each call bounded by
   ``--exec-timeout``), every call on the next sandbox in turn, so all N guests work;
   no call starts after the deadline and the window ends when the last one returned.
   Over that window: execs/s (successes), p50/p99 of their latency, failures by kind,
   pages dirtied and written back (/proc/vmstat ``nr_dirtied``/``nr_written``), and the
   machine's CPU split (/proc/stat: user with nice, system with irq and softirq, iowait);
4. deletes the N sandboxes and syncs.

Then the ratio of throughput at the largest N to the smallest (issue 15's target:
>= 0.8x). ``--admit`` then creates default sandboxes one by one until the API refuses
one (at most ``--admit-max``) and reports the count and the refusal. The node's pool is
a 64 GiB sparse file (``--pool-size-gib``): admission keeps room in it for every running
sandbox's saved state (issue 17), which on the default 20 GiB bounds a node at 59 idle
default sandboxes (measured; memory bounds it at 123).

Prints Markdown tables and one JSON line of all figures (the line starting with ``{``).
Everything the platform made is removed at the end, also on failure: sandboxes through
the API, then the server, then any QEMU, egress gateway, network namespace, mount or loop
device left under the data directory. Figures are of the whole machine: the client's
threads run on it too. Usage, as root:
`.venv/bin/python bench/bench_fill.py [--sizes 4,48] [--threads 32] [--seconds 30] [--admit]
[--pool-size-gib 64] [--guest qemu|gvisor]`. With ``--guest gvisor`` the node's ``auto``
is gVisor (``--guest-without-kvm gvisor``): its sandboxes, warm pool included, are gVisor
sandboxes, and a sandbox's VMM is its runsc sandbox and gofer and its channel relay.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._host import HostSample, Interval, mem_available_bytes
from bench._platform import Api, embedded_platform, say
from bench._stats import percentile
from space import Sandbox, Space
from space.node.core.config import NodeConfig
from space.sdk import SpaceError
from tests.integration.platform import processes_naming, qemu_pids

MIB = 1 << 20
#: A sandbox's lifetime: longer than any run, so the reaper never takes one mid-run.
LIFETIME_S = 3600
CPUS = os.cpu_count() or 1


# --- sandboxes --------------------------------------------------------------------------


def create_into(space: Space, owned: list[Sandbox], count: int, workers: int) -> list[float]:
    """Create ``count`` default sandboxes, ``workers`` at a time, appending each to
    ``owned`` as soon as it exists (so the caller can delete them whatever happens).
    Returns each create's seconds; raises the first failure once all have ended."""

    def one() -> float:
        start = time.perf_counter()
        owned.append(space.sandboxes.create(timeout_s=LIFETIME_S))
        return time.perf_counter() - start

    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(one) for _ in range(count)]
        return [future.result() for future in as_completed(futures)]


def kill_all(sandboxes: list[Sandbox]) -> None:
    """Delete every sandbox, 8 at a time; a failure is named on stderr, not raised."""

    def kill(sandbox: Sandbox) -> None:
        try:
            sandbox.kill()
        except SpaceError as e:
            say(f"could not delete {sandbox.sandbox_id}: {e!r}")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(kill, sandboxes))
    sandboxes.clear()


def vmm_pids(data_dir: Path, guest: str) -> list[int]:
    """The processes that are this data directory's sandboxes: QEMUs, or gVisor's runsc
    sandbox and gofer processes and each sandbox's channel relay (all name its run
    directory)."""
    if guest == "qemu":
        return qemu_pids(data_dir)
    return processes_naming(f"{NodeConfig(data_dir=data_dir).effective_run_dir}/")


def vmm_rss_bytes(data_dir: Path, guest: str) -> int:
    """Resident memory of every VMM (``vmm_pids``) of this data directory, summed."""
    total = 0
    for pid in vmm_pids(data_dir, guest):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def vmm_cpu_seconds(data_dir: Path, guest: str) -> float:
    """CPU time (user + system, all threads) of every VMM of this data directory."""
    ticks = 0
    for pid in vmm_pids(data_dir, guest):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def warm_up(sandboxes: list[Sandbox], workers: int, timeout_s: float) -> None:
    """One ``echo ok`` in each sandbox, ``workers`` at a time: a VM woken from a ready
    state translates its guest's code anew (TCG) on first use, which is paid once, not
    per exec, so it stays out of the timed window."""
    with ThreadPoolExecutor(workers) as pool:
        for failure in pool.map(lambda sandbox: one_exec(sandbox, timeout_s), sandboxes):
            if failure is not None:
                say(f"warm-up exec failed: {failure}")


def host_window(seconds: float) -> Interval:
    """What the machine does in the next ``seconds``."""
    before = HostSample.take()
    time.sleep(seconds)
    return HostSample.take().since(before)


# --- the exec load ----------------------------------------------------------------------


@dataclass
class ExecLoad:
    """What ``threads`` callers of ``echo ok`` saw, and what the machine did meanwhile."""

    latencies_s: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    #: The first message of each kind of failure.
    examples: dict[str, str] = field(default_factory=dict)
    host: Interval | None = None
    #: CPU time the sandboxes' VMMs (the guests) used in the window.
    vmm_cpu_s: float = 0.0


def one_exec(sandbox: Sandbox, timeout_s: float) -> tuple[str, str] | None:
    """None if ``echo ok`` ran and printed ok, else (kind of failure, message)."""
    try:
        result = sandbox.commands.run("echo ok", timeout_s=timeout_s)
    except Exception as e:  # counted, not fatal: the SDK should raise SpaceError only
        return type(e).__name__, str(e)[:300]
    if result.timed_out:
        return "timed out in the guest", f"after {timeout_s} s"
    if result.exit_code != 0:
        return f"exit {result.exit_code}", result.stderr[:300]
    if result.stdout != "ok\n":
        return "wrong output", repr(result.stdout[:100])
    return None


def exec_load(sandboxes: list[Sandbox], threads: int, seconds: float, timeout_s: float) -> ExecLoad:
    """``threads`` threads run ``echo ok`` until ``seconds`` have passed, each call on the
    next sandbox in turn; returns when the last call has returned."""
    load = ExecLoad()
    lock = threading.Lock()
    turns = itertools.count()

    def caller(deadline: float) -> None:
        while time.monotonic() < deadline:
            with lock:
                sandbox = sandboxes[next(turns) % len(sandboxes)]
            start = time.perf_counter()
            failure = one_exec(sandbox, timeout_s)
            elapsed = time.perf_counter() - start
            with lock:
                if failure is None:
                    load.latencies_s.append(elapsed)
                else:
                    load.failures[failure[0]] += 1
                    load.examples.setdefault(*failure)

    before = HostSample.take()
    deadline = time.monotonic() + seconds
    workers = [threading.Thread(target=caller, args=(deadline,)) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    load.host = HostSample.take().since(before)
    return load


# --- one size ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SizeFigures:
    """Everything measured with ``sandboxes`` on the node (seconds, MiB, shares 0..1)."""

    sandboxes: int
    create_p50_s: float
    execs: int
    execs_per_s: float
    p50_s: float
    p99_s: float
    failed: int
    failures: dict[str, int]
    failure_examples: dict[str, str]
    run_s: float
    written_mib_per_s: float
    dirtied_mib_per_s: float
    cpu_user: float
    cpu_system: float
    cpu_iowait: float
    cpu_idle: float
    idle_mem_mib_per_sandbox: float
    idle_cpu_core_share_per_sandbox: float
    idle_written_mib_per_s: float
    vmm_rss_mib_per_sandbox: float
    #: CPU per exec in the window: the guests' VMMs, and everything else (node,
    #: control plane, client, kernel outside them).
    vmm_cpu_ms_per_exec: float
    other_cpu_ms_per_exec: float


@dataclass(frozen=True)
class Options:
    threads: int
    seconds: float
    exec_timeout_s: float
    settle_s: float
    idle_s: float
    create_workers: int
    #: The guest type the node's sandboxes get (``auto`` is made to mean it).
    guest: str = "qemu"


def measure_size(space: Space, api: Api, count: int, opts: Options) -> SizeFigures:
    """Steps 1-4 of the module docstring for one N; the sandboxes are deleted even on
    failure."""
    os.sync()
    time.sleep(opts.settle_s)
    mem_before = mem_available_bytes()
    sandboxes: list[Sandbox] = []
    try:
        say(f"{count} sandboxes: creating")
        creates = create_into(space, sandboxes, count, opts.create_workers)
        warm_up(sandboxes, opts.create_workers, opts.exec_timeout_s)
        os.sync()
        time.sleep(opts.settle_s)
        mem_after, cpu_before = mem_available_bytes(), vmm_cpu_seconds(api.data_dir, opts.guest)
        idle = host_window(opts.idle_s)
        idle_core_share = (
            (vmm_cpu_seconds(api.data_dir, opts.guest) - cpu_before) / idle.seconds / count
        )
        rss = vmm_rss_bytes(api.data_dir, opts.guest)
        say(f"{count} sandboxes: {opts.threads} threads of echo ok for {opts.seconds} s")
        vmm_before = vmm_cpu_seconds(api.data_dir, opts.guest)
        load = exec_load(sandboxes, opts.threads, opts.seconds, opts.exec_timeout_s)
        load.vmm_cpu_s = vmm_cpu_seconds(api.data_dir, opts.guest) - vmm_before
    finally:
        say(f"{count} sandboxes: deleting {len(sandboxes)}")
        kill_all(sandboxes)
    return _figures(
        count, creates, load, (mem_before - mem_after) / count, idle_core_share, idle, rss / count
    )


def _figures(
    count: int,
    creates: list[float],
    load: ExecLoad,
    mem_per_sandbox: float,
    idle_core_share: float,
    idle: Interval,
    rss_per_sandbox: float,
) -> SizeFigures:
    host = load.host
    assert host is not None
    lat = load.latencies_s
    return SizeFigures(
        sandboxes=count,
        create_p50_s=statistics.median(creates),
        execs=len(lat),
        execs_per_s=len(lat) / host.seconds,
        p50_s=statistics.median(lat) if lat else float("nan"),
        p99_s=percentile(lat, 0.99) if lat else float("nan"),
        failed=sum(load.failures.values()),
        failures=dict(load.failures),
        failure_examples=load.examples,
        run_s=host.seconds,
        written_mib_per_s=host.written_bytes_per_s / MIB,
        dirtied_mib_per_s=host.dirtied_bytes_per_s / MIB,
        cpu_user=host.user,
        cpu_system=host.system,
        cpu_iowait=host.iowait,
        cpu_idle=host.idle,
        idle_mem_mib_per_sandbox=mem_per_sandbox / MIB,
        idle_cpu_core_share_per_sandbox=idle_core_share,
        idle_written_mib_per_s=idle.written_bytes_per_s / MIB,
        vmm_rss_mib_per_sandbox=rss_per_sandbox / MIB,
        vmm_cpu_ms_per_exec=1000 * load.vmm_cpu_s / max(len(lat), 1),
        other_cpu_ms_per_exec=1000
        * (host.busy * CPUS * host.seconds - load.vmm_cpu_s)
        / max(len(lat), 1),
    )


# --- admission --------------------------------------------------------------------------


@dataclass(frozen=True)
class Admission:
    admitted: int
    refusal: str | None
    seconds: float
    mem_available_mib_at_end: float


def admit(space: Space, most: int) -> Admission:
    """Create default sandboxes one by one until the API refuses one or ``most`` exist;
    deletes them all before returning, also on failure."""
    sandboxes: list[Sandbox] = []
    refusal = None
    start = time.monotonic()
    try:
        while len(sandboxes) < most:
            try:
                sandboxes.append(space.sandboxes.create(timeout_s=LIFETIME_S))
            except SpaceError as e:
                refusal = f"{type(e).__name__} (HTTP {e.status_code}): {str(e)[:300]}"
                break
            if len(sandboxes) % 8 == 0:
                say(f"admission: {len(sandboxes)} sandboxes")
        mem = mem_available_bytes() / MIB
        return Admission(len(sandboxes), refusal, time.monotonic() - start, mem)
    finally:
        kill_all(sandboxes)


# --- the report -------------------------------------------------------------------------


def _pct(share: float) -> str:
    return f"{100 * share:.0f}%"


def _failures(f: SizeFigures) -> str:
    if not f.failed:
        return "0"
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(f.failures.items()))
    return f"{f.failed} of {f.failed + f.execs} ({kinds})"


def report_sizes(sizes: list[SizeFigures], out: Callable[[str], None]) -> None:
    """The figures as Markdown tables, the ratio and the first failure of each kind."""
    out(
        "| sandboxes | execs/s | p50 | p99 | failed | written back | dirtied"
        " | CPU user / system / iowait | CPU per exec: VMM / the rest |"
    )
    out("|---|---|---|---|---|---|---|---|---|")
    for f in sizes:
        out(
            f"| {f.sandboxes} | {f.execs_per_s:.1f} | {f.p50_s:.2f} s | {f.p99_s:.2f} s"
            f" | {_failures(f)} | {f.written_mib_per_s:.0f} MiB/s | {f.dirtied_mib_per_s:.0f} MiB/s"
            f" | {_pct(f.cpu_user)} / {_pct(f.cpu_system)} / {_pct(f.cpu_iowait)}"
            f" | {f.vmm_cpu_ms_per_exec:.0f} / {f.other_cpu_ms_per_exec:.0f} ms |"
        )
    out("")
    out(
        "| sandboxes | create p50 | host memory per idle sandbox | idle CPU per sandbox"
        " | VMM RSS per sandbox | written back while idle |"
    )
    out("|---|---|---|---|---|---|")
    for f in sizes:
        out(
            f"| {f.sandboxes} | {f.create_p50_s:.2f} s | {f.idle_mem_mib_per_sandbox:.0f} MiB"
            f" | {100 * f.idle_cpu_core_share_per_sandbox:.2f}% of a core"
            f" | {f.vmm_rss_mib_per_sandbox:.0f} MiB | {f.idle_written_mib_per_s:.1f} MiB/s |"
        )
    if len(sizes) > 1:
        out(
            f"\nthroughput with {sizes[-1].sandboxes} / with {sizes[0].sandboxes}:"
            f" {ratio(sizes):.2f}x (target >= 0.8x)"
        )
    for f in sizes:
        for kind, message in f.failure_examples.items():
            out(f"{f.sandboxes} sandboxes, first {kind}: {message}")


def report_admission(admission: Admission, out: Callable[[str], None]) -> None:
    out(
        f"admitted {admission.admitted} idle default sandboxes in {admission.seconds:.0f} s;"
        f" refusal: {admission.refusal or 'none (--admit-max reached)'}"
        f"; MemAvailable then {admission.mem_available_mib_at_end:.0f} MiB"
    )


def ratio(sizes: list[SizeFigures]) -> float:
    small, large = sizes[0].execs_per_s, sizes[-1].execs_per_s
    return large / small if small else float("nan")


def as_json(
    args: argparse.Namespace, sizes: list[SizeFigures], admission: Admission | None, wall_s: float
) -> str:
    figures = {
        "bench": "fill",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": CPUS,
        "options": vars(args),
        "sizes": [{**asdict(f), "written_mib": f.written_mib_per_s * f.run_s} for f in sizes],
        "ratio": ratio(sizes) if len(sizes) > 1 else None,
        "admission": asdict(admission) if admission else None,
        "wall_s": wall_s,
    }
    return json.dumps(_rounded(figures), separators=(",", ":"), allow_nan=False, default=str)


def _rounded(value: object) -> object:
    """Floats to 4 decimals (NaN to null), through dicts and lists."""
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


# --- main -------------------------------------------------------------------------------


def run(api: Api, args: argparse.Namespace) -> tuple[list[SizeFigures], Admission | None]:
    """Every size, then admission if asked; prints the sizes' tables as soon as they are
    measured."""
    opts = Options(
        args.threads,
        args.seconds,
        args.exec_timeout,
        args.settle,
        args.idle,
        args.create_workers,
        args.guest,
    )
    with Space(api.url, api.key) as space:
        sizes = [measure_size(space, api, n, opts) for n in args.sizes]
        report_sizes(sizes, print)
        if not args.admit:
            return sizes, None
        say("admission: creating until refused")
        admission = admit(space, args.admit_max)
        report_admission(admission, print)
        return sizes, admission


def _sizes(text: str) -> list[int]:
    sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError("sizes are whole numbers >= 1, comma-separated")
    return sizes


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=_sizes, default=[4, 48], help="default 4,48")
    p.add_argument("--threads", type=int, default=32)
    p.add_argument("--seconds", type=float, default=30.0, help="of echo ok per size")
    p.add_argument("--exec-timeout", type=float, default=30.0, help="timeout_s of each exec")
    p.add_argument("--settle", type=float, default=10.0, help="wait after creates and deletes")
    p.add_argument("--idle", type=float, default=10.0, help="idle CPU window, seconds")
    p.add_argument("--create-workers", type=int, default=4, help="creates at a time")
    p.add_argument("--admit", action="store_true", help="count admitted sandboxes too")
    p.add_argument(
        "--guest", choices=["qemu", "gvisor"], default="qemu",
        help="the sandboxes' guest type (gvisor: the node's auto is gVisor, its pools too)",
    )  # fmt: skip
    p.add_argument("--admit-max", type=int, default=256)
    p.add_argument(
        "--pool-size-gib", type=int, default=64,
        help="the node's loop-file pool (sparse): room for dozens of saved states",
    )  # fmt: skip
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_fill starts VMs, mounts and namespaces: run it as root")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="space-bench-fill-") as tmp:
        say(f"starting space serve in {tmp}")
        options = ["--pool-size-gib", str(args.pool_size_gib)]
        if args.guest == "gvisor":
            options += ["--guest-without-kvm", "gvisor"]
        with embedded_platform(Path(tmp) / "data", options) as api:
            sizes, admission = run(api, args)
    print(as_json(args, sizes, admission, time.monotonic() - start))


if __name__ == "__main__":
    main()
