"""Driving observed state towards desired state: the reaper and startup reconciliation.

The reaper deletes sandboxes whose lifetime ended, by the app's injected clock.
Reconciliation compares every registered node's sandboxes with the database: rows the
node no longer knows become ``error`` (or ``deleted`` if deletion was wanted), and
sandboxes no row claims are deleted on the node, so nothing leaks across restarts.
"""

from __future__ import annotations

import asyncio
import logging

from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.lifecycle import delete_sandbox
from space.control.store import repo
from space.control.store.repo import SandboxRecord
from space.node.errors import NodeError
from space.node.interface import SandboxState, SandboxStatus

__all__ = ["reap_expired", "reaper_loop", "reconcile", "reconcile_node"]

log = logging.getLogger(__name__)


async def reap_expired(ctx: ControlContext) -> list[str]:
    """Delete every sandbox whose ``expires_at`` has passed; returns the ids deleted.

    A sandbox whose node fails is logged and left for the next round.
    """
    now = ctx.clock()
    deleted = []
    for record in await ctx.db.run(lambda s: repo.expired(s, now)):
        try:
            await delete_sandbox(ctx, record)
        except (NodeError, ApiError) as exc:
            log.warning("reaper could not delete %s: %s", record.id, exc)
            continue
        deleted.append(record.id)
    return deleted


async def reaper_loop(ctx: ControlContext, interval_s: float) -> None:
    """Reap every ``interval_s`` seconds until cancelled; a failing round is logged."""
    while True:
        try:
            await reap_expired(ctx)
        except Exception:
            log.exception("reaper round failed")
        await asyncio.sleep(interval_s)


async def _settle_row(
    ctx: ControlContext, record: SandboxRecord, status: SandboxStatus | None
) -> None:
    if record.desired_state == repo.DELETED:
        await delete_sandbox(ctx, record)
    elif status is None:
        message = "the node no longer knows this sandbox"
        await ctx.db.run(
            lambda s: repo.set_state(s, record.id, SandboxState.ERROR.value, error=message)
        )
    elif status.state.value != record.state:
        state = status.state.value
        await ctx.db.run(lambda s: repo.set_state(s, record.id, state, error=status.error))


async def reconcile_node(ctx: ControlContext, node_id: str) -> None:
    """Settle the database's rows for ``node_id`` against what the node runs.

    Raises the node's NodeError if it cannot be listed (nothing is changed then).
    """
    node = ctx.nodes.get(node_id)
    on_node = {
        status.sandbox_id: status
        for status in await node.list_sandboxes()
        if status.state != SandboxState.DELETED
    }
    rows = await ctx.db.run(lambda s: repo.on_node(s, node_id))
    for record in rows:
        await _settle_row(ctx, record, on_node.get(record.id))
    for sandbox_id in on_node.keys() - {record.id for record in rows}:
        log.info("deleting sandbox %s on node %s: no record claims it", sandbox_id, node_id)
        await node.delete_sandbox(sandbox_id)


async def reconcile(ctx: ControlContext) -> None:
    """Reconcile every registered node; a node that fails is logged and skipped."""
    for node_id in ctx.nodes.ids():
        try:
            await reconcile_node(ctx, node_id)
        except (NodeError, ApiError) as exc:
            log.warning("could not reconcile node %s: %s", node_id, exc)
