"""This replica's Prometheus histograms (issue 20), observed where the work happens and
exposed by ``GET /metrics`` (space.control.prometheus)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Histogram

__all__ = ["CREATE_SOURCES", "PlatformMetrics"]

#: What a sandbox is created from: a template (booted, its ready state or a warm pool
#: VM), a snapshot, or a live sandbox (fork).
CREATE_SOURCES = ("template", "snapshot", "fork")
#: Bucket bounds in seconds. Creates: a warm pool hit is ~0.06 s, a ready-state clone
#: ~0.3-1 s, a cold boot seconds under TCG (docs/benchmarks.md). Execs: ~35 ms of
#: process spawn under TCG, a few ms on KVM.
_CREATE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_EXEC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class PlatformMetrics:
    """This replica's histograms, in a registry of its own (one per app, so that apps in
    one process, as in tests, do not share them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._create = Histogram(
            "space_sandbox_create_seconds",
            "Seconds the node took to create a sandbox, by what it was made from.",
            ["source"],
            buckets=_CREATE_BUCKETS,
            registry=self.registry,
        )
        self._exec = Histogram(
            "space_exec_start_seconds",
            "Seconds from asking the node to run a command to the process running.",
            buckets=_EXEC_BUCKETS,
            registry=self.registry,
        )
        for source in CREATE_SOURCES:
            self._create.labels(source=source)  # every series from the start, at 0

    def observe_create(self, source: str, seconds: float, count: int = 1) -> None:
        """Record ``count`` sandboxes made from ``source`` (CREATE_SOURCES) in ``seconds``."""
        histogram = self._create.labels(source=source)
        for _ in range(count):
            histogram.observe(seconds)

    def observe_exec_start(self, seconds: float) -> None:
        self._exec.observe(seconds)

    @contextmanager
    def timing_create(self, source: str, count: int = 1) -> Iterator[None]:
        """Observe the block's duration as ``count`` creates from ``source``, if it
        succeeds (a failed create is no latency to show)."""
        started = time.monotonic()
        yield
        self.observe_create(source, time.monotonic() - started, count)

    @contextmanager
    def timing_exec_start(self) -> Iterator[None]:
        """Observe the block's duration as an exec's start, if it succeeds."""
        started = time.monotonic()
        yield
        self.observe_exec_start(time.monotonic() - started)
