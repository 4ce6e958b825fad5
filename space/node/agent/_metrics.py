"""Per-sandbox metrics: samples from spaced, a few kept per sandbox on the node.

A sample is taken when someone asks (``Node.sandbox_metrics``) and the last one is
older than METRICS_INTERVAL_S; the node never samples on its own, so an idle sandbox
nobody watches costs nothing. The samples live in memory with the LiveSandbox (gone
with it, and after a node restart): a sandbox that is paused, hibernated or stopped
answers what was kept and is never woken for it. A gVisor sandbox's CPU figures are
of its spec's CPUs, not the host's it sees (see ``sandbox_metrics``).
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable

from space.node.agent._registry import Registry
from space.node.api import (
    MAX_METRICS_SAMPLES,
    METRICS_INTERVAL_S,
    SandboxMetrics,
    SandboxState,
)
from space.node.channel import GuestChannel
from space.node.core.sandbox import LiveSandbox

__all__ = ["MetricsKeeper"]


class MetricsKeeper:
    """The recent samples of each live sandbox. ``clock`` is the wall clock (the
    samples' timestamps; injected by tests)."""

    def __init__(self, registry: Registry, clock: Callable[[], float] = time.time) -> None:
        self._registry = registry
        self._clock = clock
        # Keyed by the LiveSandbox itself: a deleted sandbox's samples go with it.
        self._samples: weakref.WeakKeyDictionary[LiveSandbox, deque[SandboxMetrics]] = (
            weakref.WeakKeyDictionary()
        )

    async def sandbox_metrics(
        self, sandbox_id: str, channel: Callable[[str], Awaitable[GuestChannel]]
    ) -> list[SandboxMetrics]:
        """The kept samples, oldest first, after a new one if the sandbox is RUNNING and
        the last is older than METRICS_INTERVAL_S. ``channel(sandbox_id)`` opens the
        guest channel. NotFound; the guest's errors (Unavailable, Timeout)."""
        sandbox = self._registry.get(sandbox_id)
        samples = self._samples.setdefault(sandbox, deque(maxlen=MAX_METRICS_SAMPLES))
        now = self._clock()
        fresh = samples and now - samples[-1].timestamp < METRICS_INTERVAL_S
        if sandbox.record.state == SandboxState.RUNNING and not fresh:
            sample = await (await channel(sandbox_id)).metrics()
            cpu_count, cpu_used_pct = sample.cpu_count, sample.cpu_used_pct
            if sandbox.record.guest == "gvisor":
                # gVisor shows the host's CPUs and their busy share; its cgroup's quota
                # holds it to the spec's: report those, and the share of them it used.
                cpus = sandbox.record.spec.cpus
                cpu_used_pct = round(min(100.0, cpu_used_pct * cpu_count / cpus), 2)
                cpu_count = cpus
            samples.append(
                SandboxMetrics(
                    timestamp=self._clock(),
                    cpu_count=cpu_count,
                    cpu_used_pct=cpu_used_pct,
                    mem_used=sample.mem_used,
                    mem_total=sample.mem_total,
                    disk_used=sample.disk_used,
                    disk_total=sample.disk_total,
                )
            )
        return list(samples)
