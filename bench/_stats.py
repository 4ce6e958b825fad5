"""How the benchmarks print their figures."""

from __future__ import annotations

import statistics

__all__ = ["percentile", "summary"]


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile of ``values`` (``fraction`` in 0..1; 0.5 is not the
    median of an even count: use ``statistics.median`` for that). Raises ValueError if
    ``values`` is empty."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    return ordered[max(0, round(fraction * len(ordered)) - 1)]


def summary(name: str, values: list[float], unit: str) -> str:
    """One line: median and p90 of ``values`` and their count."""
    return (
        f"{name:<34} median {statistics.median(values):9.2f} {unit:<3}"
        f" p90 {percentile(values, 0.9):9.2f} {unit:<3} n={len(values)}"
    )
