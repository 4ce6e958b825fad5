"""Driving observed state towards desired state: the reaper and startup reconciliation.

The reaper deletes sandboxes whose lifetime ended and hibernates those idle for their
``idle_timeout_s``, by the app's injected clock, records as ``error`` (with the node's
reason) the sandboxes whose VM a node saw exit, and sends secret grants again to nodes
that restarted (space.control.broker: a node holds them in memory only).
Reconciliation compares every registered node's sandboxes and snapshots with the
database: rows the node no longer knows become ``error`` (or ``deleted`` if deletion
was wanted), pending snapshot rows are published if the node finished them and
dropped if not, and sandboxes or snapshots no row claims are deleted on the node, so
nothing leaks across restarts. Rows younger than ``reconcile_grace_s`` that are still
being made are left alone: another replica may be making them. Both run in one replica at a
time (space.control.background).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import replace

from space.control import broker, idempotency
from space.control.archived import keeps_copy
from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.lifecycle import delete_sandbox, hibernate_sandbox
from space.control.snapshots import delete_snapshot
from space.control.store import repo
from space.control.store import snapshots as snaps
from space.control.store.repo import SandboxRecord
from space.node.api import NodeError, NotFound, SandboxState, SandboxStatus, SnapshotInfo

__all__ = [
    "hibernate_idle",
    "notice_failed_vms",
    "reap",
    "reap_expired",
    "reconcile",
    "reconcile_node",
]

log = logging.getLogger(__name__)

#: Row states that claim a VM runs (or stands paused) on the node.
_LIVE = (SandboxState.RUNNING.value, SandboxState.PAUSED.value)


async def reap_expired(ctx: ControlContext) -> list[str]:
    """Delete every sandbox whose ``expires_at`` has passed; returns the ids deleted.

    A sandbox whose node fails is logged and left for the next round.
    """
    now = ctx.clock()
    deleted = []
    for record in await ctx.db.read(lambda s: repo.expired(s, now)):
        try:
            await delete_sandbox(ctx, record)
        except (NodeError, ApiError) as exc:
            log.warning("reaper could not delete %s: %s", record.id, exc)
            continue
        deleted.append(record.id)
    return deleted


async def hibernate_idle(ctx: ControlContext) -> list[str]:
    """Hibernate every running or paused sandbox idle for its ``idle_timeout_s``.

    Idle means no guest activity (or, if none, creation) for at least that long; a
    sandbox with an exec or process stream open in this replica is busy, not idle.
    Returns the ids hibernated; a sandbox whose node fails is logged and retried next
    round.
    """
    now = ctx.clock()
    await ctx.activity.write()  # this replica's marks not written yet count too
    busy = ctx.activity.streaming()
    hibernated = []
    for record in await ctx.db.read(lambda s: repo.idle(s, now)):
        if record.id in busy:
            continue
        try:
            await hibernate_sandbox(ctx, record)
        except (NodeError, ApiError) as exc:
            log.warning("reaper could not hibernate %s: %s", record.id, exc)
            continue
        hibernated.append(record.id)
    return hibernated


async def notice_failed_vms(ctx: ControlContext) -> list[str]:
    """Record as ``error`` every running or paused sandbox whose node reports it in
    ERROR (its VM exited unasked), with the node's reason; returns their ids.

    A row an operation changed meanwhile is left to that operation; a node that cannot
    be listed is logged and asked again next round.
    """
    failed = []
    for node_id in ctx.nodes.ids():
        try:
            statuses = await ctx.nodes.get(node_id).list_sandboxes()
        except (NodeError, ApiError) as exc:
            log.warning("could not list the sandboxes of node %s: %s", node_id, exc)
            continue
        errors = {s.sandbox_id: s for s in statuses if s.state == SandboxState.ERROR}
        if errors:
            failed += await _mark_failed(ctx, node_id, errors)
    return failed


async def _mark_failed(
    ctx: ControlContext, node_id: str, errors: dict[str, SandboxStatus]
) -> list[str]:
    failed = []
    for record in await ctx.db.run(lambda s: repo.on_node(s, node_id)):
        status = errors.get(record.id)
        if status is None or record.state not in _LIVE:
            continue
        reason = status.error or "the node reports the sandbox in error"
        mark = functools.partial(
            repo.mark_failed, sandbox_id=record.id, seen_state=record.state, error=reason
        )
        if await ctx.db.run(mark):
            log.warning("sandbox %s on node %s failed: %s", record.id, node_id, reason)
            failed.append(record.id)
    return failed


async def reap(ctx: ControlContext) -> None:
    """One reaper round: delete expired sandboxes, hibernate idle ones, record failed
    VMs, send grants to nodes whose boot id changed, forget expired idempotency keys."""
    await reap_expired(ctx)
    await hibernate_idle(ctx)
    await notice_failed_vms(ctx)
    await broker.sync_restarted_nodes(ctx)
    await idempotency.sweep(ctx)


async def _settle_row(
    ctx: ControlContext, record: SandboxRecord, status: SandboxStatus | None, grace_s: float
) -> None:
    if record.desired_state == repo.DELETED:
        await delete_sandbox(ctx, record)
    elif status is None and _in_flight(ctx, record.state, record.created_at, grace_s):
        return
    elif status is None:
        message = "the node no longer knows this sandbox"
        await ctx.db.run(
            lambda s: repo.set_state(s, record.id, SandboxState.ERROR.value, error=message)
        )
    elif (status.state.value, status.head_snapshot, status.archive) != (
        record.state,
        record.head_snapshot,
        record.archive,
    ):
        await ctx.db.run(lambda s: repo.set_status(s, record.id, status))


def _in_flight(ctx: ControlContext, state: str, created_at: float, grace_s: float) -> bool:
    """Whether a row in ``state`` may belong to an operation still running elsewhere: a
    sandbox ``creating`` or a snapshot ``pending`` for less than ``grace_s`` (another
    replica may be making it; a later round settles it if it stays so)."""
    started = state in (SandboxState.CREATING.value, snaps.PENDING)
    return started and ctx.clock() - created_at < grace_s


async def reconcile_node(
    ctx: ControlContext, node_id: str, *, grace_s: float | None = None
) -> None:
    """Settle the database's rows for ``node_id`` against what the node runs.

    Sandboxes first, then snapshots. Rows still being made are left alone for
    ``grace_s`` (None: the settings' ``reconcile_grace_s``). Raises the node's NodeError
    if it cannot be listed (nothing is changed then).
    """
    grace = ctx.settings.reconcile_grace_s if grace_s is None else grace_s
    node = ctx.nodes.get(node_id)
    on_node = {
        status.sandbox_id: status
        for status in await node.list_sandboxes()
        if status.state != SandboxState.DELETED
    }
    rows = await ctx.db.run(lambda s: repo.on_node(s, node_id))
    for record in rows:
        await _settle_row(ctx, record, on_node.get(record.id), grace)
    for sandbox_id in on_node.keys() - {record.id for record in rows}:
        log.info("deleting sandbox %s on node %s: no record claims it", sandbox_id, node_id)
        await node.delete_sandbox(sandbox_id)
    await _reconcile_snapshots(ctx, node_id, grace)


async def _settle_snapshot(
    ctx: ControlContext, record: snaps.SnapshotRecord, info: SnapshotInfo | None, grace_s: float
) -> None:
    if record.state == snaps.DELETING:
        await delete_snapshot(ctx, record)
    elif record.state == snaps.PENDING and info is None:
        if _in_flight(ctx, record.state, record.created_at, grace_s):
            return
        await ctx.db.run(lambda s: snaps.drop_pending(s, record.id))
    elif record.state == snaps.PENDING and info is not None:
        # The node finished it after the control plane stopped waiting: publish it.
        ready = replace(
            record, state=snaps.READY, parent_id=info.parent_id, memory_bytes=info.memory_bytes
        )
        await ctx.db.run(lambda s: snaps.mark_ready(s, ready))
    elif info is None:
        log.warning("snapshot %s is listed but its node %s lost it", record.id, record.node_id)


async def _reconcile_snapshots(ctx: ControlContext, node_id: str, grace_s: float) -> None:
    node = ctx.nodes.get(node_id)
    on_node = {info.snapshot_id: info for info in await node.list_snapshots()}
    rows = await ctx.db.run(lambda s: snaps.on_node(s, node_id))
    for record in rows:
        await _settle_snapshot(ctx, record, on_node.get(record.id), grace_s)
    for snapshot_id in on_node.keys() - {record.id for record in rows}:
        listed = await ctx.db.run(functools.partial(snaps.get_snapshot, snapshot_id=snapshot_id))
        if keeps_copy(listed):  # fetched from the artifact store
            continue
        log.info("deleting snapshot %s on node %s: no record claims it", snapshot_id, node_id)
        with contextlib.suppress(NotFound):
            await node.delete_snapshot(snapshot_id)


async def reconcile(ctx: ControlContext, *, grace_s: float | None = None) -> None:
    """Reconcile every registered node (``grace_s`` as ``reconcile_node``); a node that
    fails is logged and skipped."""
    for node_id in ctx.nodes.ids():
        try:
            await reconcile_node(ctx, node_id, grace_s=grace_s)
        except (NodeError, ApiError) as exc:
            log.warning("could not reconcile node %s: %s", node_id, exc)
