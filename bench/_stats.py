"""How the benchmarks print their figures."""

from __future__ import annotations

import statistics

__all__ = ["summary"]


def summary(name: str, values: list[float], unit: str) -> str:
    """One line: median and p90 of ``values`` and their count."""
    ordered = sorted(values)
    p90 = ordered[max(0, round(0.9 * len(ordered)) - 1)]
    return (
        f"{name:<34} median {statistics.median(ordered):9.2f} {unit:<3}"
        f" p90 {p90:9.2f} {unit:<3} n={len(values)}"
    )
