"""``space pools``: the warm pools of every node, as a table."""

from __future__ import annotations

import click

from space.cli._common import api_options, connection, echo_table, reports_errors
from space.sdk import PoolInfo, Sandbox

__all__ = ["pools"]


@click.command()
@api_options
@reports_errors
def pools(api_url: str | None, api_key: str | None) -> None:
    """List every node's warm pools: paused VMs per template, ready for a create."""
    rows = [_pool_row(pool) for pool in Sandbox.list_pools(**connection(api_url, api_key))]
    header = ("NODE", "TEMPLATE", "SIZE/TARGET", "MIN..MAX", "HITS", "MISSES", "HIT_RATE")
    echo_table(header, rows)


def _pool_row(pool: PoolInfo) -> tuple[str, ...]:
    return (
        pool.node_id,
        pool.template,
        f"{pool.size}/{pool.target}",
        f"{pool.min_size}..{pool.max_size}",
        str(pool.hits),
        str(pool.misses),
        hit_rate(pool.hit_rate),
    )


def hit_rate(rate: float | None) -> str:
    """A hit rate as a percentage with one decimal (``75.0%``); ``-`` before any create."""
    return "-" if rate is None else f"{rate:.1%}"
