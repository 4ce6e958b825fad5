"""``space metrics ID``: a sandbox's recent CPU, memory and disk samples (through the SDK)."""

from __future__ import annotations

import click

from space.cli._common import api_options, connected, echo_table, reports_errors
from space.sdk import SandboxMetric

__all__ = ["metrics"]

_MIB = 1024 * 1024


@click.command()
@click.argument("sandbox_id")
@api_options
@reports_errors
def metrics(sandbox_id: str, api_url: str | None, api_key: str | None) -> None:
    """Show a sandbox's recent CPU, memory and disk use, oldest first.

    A running sandbox is sampled now (at most every 5 s); a paused or hibernated one is
    not woken: it shows what its node kept. Sizes in MiB.
    """
    with connected(sandbox_id, api_url, api_key) as sandbox:
        samples = sandbox.get_metrics()
    header = ("TIME", "CPUS", "CPU_PCT", "MEM_USED_MIB", "MEM_TOTAL_MIB")
    echo_table((*header, "DISK_USED_MIB", "DISK_TOTAL_MIB"), [_row(s) for s in samples])


def _row(sample: SandboxMetric) -> tuple[str, ...]:
    return (
        sample.timestamp.strftime("%Y-%m-%d %H:%M:%S"),
        str(sample.cpu_count),
        f"{sample.cpu_used_pct:.1f}",
        *(str(n // _MIB) for n in (sample.mem_used, sample.mem_total)),
        *(str(n // _MIB) for n in (sample.disk_used, sample.disk_total)),
    )
