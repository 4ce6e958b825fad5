"""``system.metrics``: one sample of the guest's CPU, memory and root disk.

CPU use is a delta of /proc/stat's aggregate ``cpu`` line since the previous sample
(the kernel's counters only ever count up since boot, so one reading says nothing
about now); the first sample of a daemon measures over ``FIRST_WINDOW_S`` instead.
Memory is /proc/meminfo's MemTotal and MemTotal - MemAvailable (what the kernel could
not hand to a new program without swapping; page cache is not counted as used), disk
is ``os.statvfs("/")``. Values are clamped into space.protocol.Metrics' bounds, which
the host checks again.
"""

from __future__ import annotations

import asyncio
import os

from space.protocol import MAX_METRICS_BYTES, MAX_METRICS_CPUS, Metrics

__all__ = ["FIRST_WINDOW_S", "MetricsSampler"]

#: How long the first sample watches the CPU counters: long enough for a few ticks at
#: the kernel's usual 100 Hz USER_HZ, short enough not to hold the request up.
FIRST_WINDOW_S = 0.1
#: Columns of /proc/stat's cpu line that count time (user nice system idle iowait irq
#: softirq steal; guest and guest_nice are already inside user and nice), and those
#: that count idle time (idle, iowait): proc(5).
_TIME_COLUMNS = 8
_IDLE_COLUMNS = (3, 4)


class MetricsSampler:
    """Keeps the previous CPU reading between samples, so each sample covers the time
    since the one before it."""

    def __init__(self, stat_path: str = "/proc/stat", meminfo_path: str = "/proc/meminfo") -> None:
        self._stat_path = stat_path
        self._meminfo_path = meminfo_path
        self._previous: tuple[int, int] | None = None

    async def sample(self) -> dict[str, object]:
        """The RESULT of system.metrics; OSError when /proc cannot be read."""
        cpu_count, busy_pct = await self._cpu()
        mem_total, mem_available = self._memory()
        disk = os.statvfs("/")
        disk_total = disk.f_blocks * disk.f_frsize
        disk_used = (disk.f_blocks - disk.f_bfree) * disk.f_frsize
        mem_total, mem_used = _bounded(mem_total, mem_total - mem_available)
        disk_total, disk_used = _bounded(disk_total, disk_used)
        metrics = Metrics(
            cpu_count=cpu_count,
            cpu_used_pct=busy_pct,
            mem_used=mem_used,
            mem_total=mem_total,
            disk_used=disk_used,
            disk_total=disk_total,
        )
        return metrics.to_result()

    async def _cpu(self) -> tuple[int, float]:
        previous = self._previous
        cpu_count, now = self._read_stat()
        if previous is None or now[0] <= previous[0] or now[1] < previous[1]:
            previous = now  # no earlier reading (or a counter went back): watch a while
            await asyncio.sleep(FIRST_WINDOW_S)
            cpu_count, now = self._read_stat()
        self._previous = now
        total, idle = now[0] - previous[0], now[1] - previous[1]
        busy_pct = 0.0 if total <= 0 else 100.0 * (total - min(idle, total)) / total
        return cpu_count, round(min(100.0, max(0.0, busy_pct)), 2)

    def _read_stat(self) -> tuple[int, tuple[int, int]]:
        """(online CPUs, (total ticks, idle ticks)) from /proc/stat."""
        with open(self._stat_path, encoding="ascii") as file:
            lines = file.read(1 << 20).splitlines()
        columns = [int(value) for value in lines[0].split()[1 : 1 + _TIME_COLUMNS]]
        cpus = sum(1 for line in lines[1:] if line.startswith("cpu"))
        cpu_count = min(MAX_METRICS_CPUS, max(1, cpus or os.cpu_count() or 1))
        idle = sum(columns[i] for i in _IDLE_COLUMNS if i < len(columns))
        return cpu_count, (sum(columns), idle)

    def _memory(self) -> tuple[int, int]:
        """(MemTotal, MemAvailable) in bytes."""
        values: dict[str, int] = {}
        with open(self._meminfo_path, encoding="ascii") as file:
            for line in file.read(1 << 20).splitlines():
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable", "MemFree"):
                    values[name] = int(rest.split()[0]) * 1024  # the kernel writes kB
        total = values.get("MemTotal", 0)
        return total, values.get("MemAvailable", values.get("MemFree", total))


def _bounded(total: int, used: int) -> tuple[int, int]:
    """(total, used) within the protocol's bounds: 1 <= total <= max, 0 <= used <= total."""
    total = min(MAX_METRICS_BYTES, max(1, total))
    return total, min(total, max(0, used))
