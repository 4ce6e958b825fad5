"""Snapshots, restore and fork: the control plane's side of the snapshot tree (issue 3).

Rows are written before a node is asked, as sandbox creation does: a snapshot row is
``pending`` (never listed) until its node returns it, so a crash mid-way lists
nothing half-made and reconciliation drops the row, or publishes it if the node
finished; deletion hides the row (``deleting``) before the node deletes, and a retry or
reconciliation finishes it. Fork rows are ``creating`` until the node answers.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from dataclasses import replace

from sqlalchemy.orm import Session

from space.control import broker, egress, idempotency, lifecycle, quota_checks
from space.control.archived import fetch_snapshot
from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.idempotency import Idempotency
from space.control.lifecycle import LIVE, check_state, new_sandbox_id, record_status
from space.control.store import quotas as quota_store
from space.control.store import repo
from space.control.store import snapshots as snaps
from space.control.store.repo import SandboxRecord
from space.control.store.snapshots import SnapshotRecord
from space.node.api import NodeError, NotFound, SandboxState

__all__ = [
    "delete_snapshot",
    "find_snapshot",
    "fork_sandbox",
    "measure_snapshot",
    "new_snapshot_id",
    "restore_sandbox",
    "take_snapshot",
]

log = logging.getLogger(__name__)


def new_snapshot_id() -> str:
    """An unguessable snapshot id (96 random bits)."""
    return "sn-" + secrets.token_hex(12)


async def find_snapshot(ctx: ControlContext, tenant: str, snapshot_id: str) -> SnapshotRecord:
    """The tenant's listed snapshot; ApiError(not_found) for any other id."""
    found = await ctx.db.run(lambda s: snaps.find_snapshot(s, tenant, snapshot_id))
    if found is None:
        raise ApiError("not_found", f"no snapshot {snapshot_id!r}", snapshot_id=snapshot_id)
    return found


def _pending(ctx: ControlContext, sandbox: SandboxRecord, name: str) -> SnapshotRecord:
    return SnapshotRecord(
        id=new_snapshot_id(),
        tenant_id=sandbox.tenant_id,
        sandbox_id=sandbox.id,
        node_id=sandbox.node_id,
        name=name,
        parent_id=sandbox.head_snapshot,
        state=snaps.PENDING,
        created_at=ctx.clock(),
        template=sandbox.template,
        cpus=sandbox.cpus,
        memory_mib=sandbox.memory_mib,
        disk_mib=sandbox.disk_mib,
        memory_bytes=0,
    )


async def take_snapshot(ctx: ControlContext, sandbox: SandboxRecord, name: str) -> SnapshotRecord:
    """Snapshot a running, paused or hibernated sandbox (it keeps its state).

    Raises ApiError(conflict) for another state (naming it) or for a live snapshot of
    that name of this sandbox (``details.snapshot_id`` the existing one),
    ApiError(resource_exhausted) past the tenant's ``snapshots`` quota, or the node's
    NodeError (nothing is listed then). The new snapshot becomes the sandbox's head.
    """
    check_state("snapshot", sandbox, LIVE)
    node = ctx.nodes.get(sandbox.node_id)
    pending = _pending(ctx, sandbox, name)
    await _claim_name(ctx, pending)
    try:
        info = await node.snapshot_sandbox(sandbox.id, pending.id)
    except NodeError:
        # It may exist half-made, or whole if only the answer was lost: forget it.
        with contextlib.suppress(NodeError):
            await node.delete_snapshot(pending.id)
        await ctx.db.run(lambda s: snaps.drop_pending(s, pending.id))
        raise
    ready = replace(
        pending, state=snaps.READY, parent_id=info.parent_id, memory_bytes=info.memory_bytes
    )
    await ctx.db.run(lambda s: snaps.mark_ready(s, ready))
    return ready


async def _claim_name(ctx: ControlContext, pending: SnapshotRecord) -> None:
    """Insert the pending row unless its sandbox has a live snapshot of that name (409)
    or its tenant's ``snapshots`` are all used (429; nothing inserted)."""

    def claim(session: Session) -> SnapshotRecord | None:
        # Locked before the name is looked up: two claims of one name (through two
        # replicas, too) cannot both find it free.
        quota_store.lock_tenant(session, pending.tenant_id)
        existing = snaps.find_live_by_name(session, pending.sandbox_id, pending.name)
        if existing is None:
            quota_checks.insert_snapshot(session, ctx.settings.quotas, pending)
        return existing

    existing = await ctx.db.run(claim)
    if existing is not None:
        raise ApiError(
            "conflict",
            f"sandbox {pending.sandbox_id} already has a snapshot named {pending.name!r}",
            sandbox_id=pending.sandbox_id,
            snapshot_id=existing.id,
        )


async def measure_snapshot(ctx: ControlContext, record: SnapshotRecord) -> int | None:
    """The snapshot's exclusive bytes as its node measures them (node errors raised)."""
    info = await ctx.nodes.get(record.node_id).get_snapshot(record.id)
    return info.exclusive_bytes


async def delete_snapshot(ctx: ControlContext, record: SnapshotRecord) -> None:
    """Delete a snapshot; its children and heads are re-parented to its parent.

    Idempotent: a deleted one is done; a half-deleted one (its node failed) is retried.
    Its bundle in the artifact store goes stale with it (space.control.archives).
    Raises ApiError(unavailable) or the node's NodeError, the snapshot then hidden and
    left for a retry or reconciliation.
    """
    if record.state == snaps.DELETED:
        return
    if record.state != snaps.DELETING:
        now = ctx.clock()
        await ctx.db.run(lambda s: snaps.mark_deleting(s, record, now))
    # A lost node is not waited for: when it is back, reconciliation deletes its copy
    # (no row claims it), as it deletes copies fetched from the store on other nodes.
    if record.node_id not in ctx.nodes.lost:
        with contextlib.suppress(NotFound):
            await ctx.nodes.get(record.node_id).delete_snapshot(record.id)
    await ctx.db.run(lambda s: snaps.mark_deleted(s, record.id))


async def restore_sandbox(
    ctx: ControlContext, sandbox: SandboxRecord, snapshot: SnapshotRecord
) -> SandboxRecord:
    """Roll ``sandbox`` back to ``snapshot`` in place; returns it running, marked active.

    Raises ApiError(conflict) unless the sandbox is running, paused or hibernated, or
    if the snapshot is on another node and not in the artifact store (one that is
    is copied here first: space.control.archived); ApiError(invalid_argument) if its template or
    resources differ; ApiError(resource_exhausted) for a hibernated sandbox its
    tenant's running quotas have no room for; or the node's NodeError (the row then as
    the node reports it).
    """
    check_state("restore", sandbox, LIVE)
    _check_same_shape(sandbox, snapshot)
    await fetch_snapshot(ctx, snapshot, sandbox.node_id)
    node = ctx.nodes.get(sandbox.node_id)
    async with quota_checks.waking(ctx, sandbox, "restore"):  # it comes back running
        try:
            status = await node.restore_sandbox(sandbox.id, snapshot.id)
        except NodeError:
            with contextlib.suppress(NodeError):
                await record_status(ctx, sandbox, await node.get_sandbox(sandbox.id))
            raise
        return await record_status(ctx, sandbox, status, active=True)


def _check_same_shape(sandbox: SandboxRecord, snapshot: SnapshotRecord) -> None:
    fields = ("template", "cpus", "memory_mib", "disk_mib")
    differ = [f for f in fields if getattr(sandbox, f) != getattr(snapshot, f)]
    if differ:
        raise ApiError(
            "invalid_argument",
            f"snapshot {snapshot.id} differs from sandbox {sandbox.id} in {', '.join(differ)}",
            sandbox_id=sandbox.id,
            snapshot_id=snapshot.id,
        )


def _child(ctx: ControlContext, parent: SandboxRecord) -> SandboxRecord:
    now = ctx.clock()
    lifetime = parent.max_lifetime_s
    return replace(
        parent,
        id=new_sandbox_id(),
        state=SandboxState.CREATING.value,
        desired_state=repo.RUNNING,
        created_at=now,
        expires_at=None if lifetime is None else now + lifetime,
        error=None,
        deleted_at=None,
        last_active_at=None,
    )


async def fork_sandbox(
    ctx: ControlContext, parent: SandboxRecord, count: int, idem: Idempotency | None = None
) -> list[SandboxRecord]:
    """``count`` new running copies of a running, paused or hibernated sandbox.

    The children share the parent's tenant, node, template, resources, env, metadata,
    egress policy, secret bindings (placeholders included: their memory holds them) and
    timeouts (their lifetime counted from their own creation); the parent keeps its
    state. Raises ApiError(conflict) naming the parent's state,
    ApiError(resource_exhausted) if the tenant's quotas have no room for all the
    children (none is made), or the
    node's NodeError (the children's rows are then deleted, on the node too).
    Idempotent with ``idem``: a retry gets the children the first request made, as
    they are now (space.control.idempotency).
    """
    return await idempotency.once(ctx, idem, lambda claim: _fork(ctx, parent, count, claim))


async def _fork(
    ctx: ControlContext, parent: SandboxRecord, count: int, idem: Idempotency | None
) -> list[SandboxRecord]:
    check_state("fork", parent, LIVE)
    children = [_child(ctx, parent) for _ in range(count)]
    await quota_checks.insert_sandboxes(ctx, children, "fork", idem)
    node = ctx.nodes.get(parent.node_id)
    try:
        with ctx.metrics.timing_create("fork", count=len(children)):
            statuses = await node.fork_sandbox(parent.id, [child.id for child in children])
    except NodeError:
        await _fork_failed(ctx, children)
        raise
    await egress.push_to_children(ctx, children)
    await broker.push_to_children(ctx, children)
    by_id = {status.sandbox_id: status for status in statuses}
    return [await record_status(ctx, child, by_id[child.id]) for child in children]


async def _fork_failed(ctx: ControlContext, children: list[SandboxRecord]) -> None:
    # The tenant never saw these ids: delete them rather than list them in error.
    for child in children:
        try:
            await lifecycle.delete_sandbox(ctx, child)
        except (NodeError, ApiError) as exc:
            log.warning("could not delete failed fork child %s: %s", child.id, exc)
