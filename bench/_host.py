"""What the host's kernel says about the whole machine (and one process), read from /proc.

``HostSample.take()`` reads /proc/stat, /proc/vmstat and /proc/meminfo at one moment; the
difference of two samples (``later.since(earlier)``) gives the CPU split and the pages
dirtied and written back between them. Figures are for the whole machine: every process
and kernel thread counts, the benchmark's own client too.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PAGE_BYTES", "HostSample", "Interval", "mem_available_bytes", "process_cpu_ms"]

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
#: /proc/stat's "cpu" columns, in order (proc(5)); guest times are already in user.
_CPU_COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _cpu_jiffies(stat: str) -> dict[str, int]:
    for line in stat.splitlines():
        if line.startswith("cpu "):
            values = [int(v) for v in line.split()[1 : 1 + len(_CPU_COLUMNS)]]
            return dict(zip(_CPU_COLUMNS, values, strict=False))
    raise RuntimeError("no aggregate cpu line in /proc/stat")


def _vmstat(text: str) -> dict[str, int]:
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2}


def mem_available_bytes() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


@dataclass(frozen=True)
class Interval:
    """What the machine did between two samples."""

    seconds: float
    #: Share of all CPUs' time, 0..1: user (with nice), system (with irq and softirq),
    #: iowait, idle, steal.
    user: float
    system: float
    iowait: float
    idle: float
    steal: float
    #: Page-cache pages dirtied and written back (``nr_dirtied``/``nr_written``), in bytes.
    dirtied_bytes: int
    written_bytes: int

    @property
    def busy(self) -> float:
        """Share of all CPUs' time not idle and not waiting for I/O, 0..1."""
        return self.user + self.system + self.steal

    @property
    def written_bytes_per_s(self) -> float:
        return self.written_bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def dirtied_bytes_per_s(self) -> float:
        return self.dirtied_bytes / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class HostSample:
    """The kernel's counters at one moment (monotonic time in seconds)."""

    at_s: float
    cpu: dict[str, int]
    vmstat: dict[str, int]

    @classmethod
    def take(cls) -> HostSample:
        return cls(
            at_s=time.monotonic(),
            cpu=_cpu_jiffies(Path("/proc/stat").read_text()),
            vmstat=_vmstat(Path("/proc/vmstat").read_text()),
        )

    def since(self, earlier: HostSample) -> Interval:
        """The interval from ``earlier`` to this sample."""
        cpu = {k: self.cpu[k] - earlier.cpu[k] for k in self.cpu}
        total = sum(cpu.values()) or 1

        def pages(name: str) -> int:
            return self.vmstat.get(name, 0) - earlier.vmstat.get(name, 0)

        return Interval(
            seconds=self.at_s - earlier.at_s,
            user=(cpu["user"] + cpu["nice"]) / total,
            system=(cpu["system"] + cpu["irq"] + cpu["softirq"]) / total,
            iowait=cpu["iowait"] / total,
            idle=cpu["idle"] / total,
            steal=cpu["steal"] / total,
            dirtied_bytes=pages("nr_dirtied") * PAGE_BYTES,
            written_bytes=pages("nr_written") * PAGE_BYTES,
        )


def process_cpu_ms(pid: int) -> float:
    """CPU time every thread of process ``pid`` has run, in ms (schedstat's ns): what
    that process spent, however loaded the machine is (wall times are not)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return total / 1e6
