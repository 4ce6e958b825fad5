"""Sandbox creation and deletion: desired state is recorded before a node is asked.

Both are safe to retry: create writes its row (``creating``) before calling the node,
so a crash mid-way leaves a row that reconciliation settles; delete records
``desired_state=deleted`` first, tolerates a node that no longer knows the sandbox,
and does nothing for a sandbox already deleted.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from dataclasses import replace

from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.scheduler import pick_node
from space.control.schemas import SandboxCreate
from space.control.store import repo
from space.control.store.repo import SandboxRecord
from space.node.errors import NodeError, NotFound
from space.node.interface import SandboxSpec, SandboxState, SandboxStatus

__all__ = [
    "create_sandbox",
    "delete_sandbox",
    "new_sandbox_id",
    "pause_sandbox",
    "resume_sandbox",
]

#: The states pause and resume accept (either is a no-op on the state it leads to).
_PAUSABLE = frozenset({SandboxState.RUNNING.value, SandboxState.PAUSED.value})

log = logging.getLogger(__name__)


def new_sandbox_id() -> str:
    """An unguessable sandbox id (96 random bits) the node's id rules accept."""
    return "sb-" + secrets.token_hex(12)


async def _place(ctx: ControlContext) -> str:
    load = await ctx.db.run(repo.active_counts)
    node_id = pick_node(ctx.nodes.ids(), load)
    if node_id is None:
        raise ApiError("unavailable", "no node is registered to run sandboxes")
    return node_id


async def create_sandbox(
    ctx: ControlContext, tenant: str, body: SandboxCreate, *, timeout_given: bool
) -> SandboxRecord:
    """Record, place and start a sandbox; returns it running.

    Raises ApiError(unavailable) with no node, or the node's NodeError (with the new
    sandbox's id in its details, the row then in state ``error``). Cancelled mid-way,
    the row stays ``creating`` until reconciliation.
    """
    node_id = await _place(ctx)
    now = ctx.clock()
    timeout_s = body.timeout_s if timeout_given else ctx.settings.default_timeout_s
    record = SandboxRecord(
        id=new_sandbox_id(),
        tenant_id=tenant,
        node_id=node_id,
        template=body.template,
        cpus=body.cpus,
        memory_mib=body.memory_mib,
        disk_mib=body.disk_mib,
        env=dict(body.env),
        metadata=dict(body.metadata),
        state=SandboxState.CREATING.value,
        desired_state=repo.RUNNING,
        created_at=now,
        expires_at=None if timeout_s is None else now + timeout_s,
    )
    await ctx.db.run(lambda s: repo.insert_sandbox(s, record))
    spec = SandboxSpec(
        sandbox_id=record.id,
        template=record.template,
        cpus=record.cpus,
        memory_mib=record.memory_mib,
        disk_mib=record.disk_mib,
        env=record.env,
    )
    node = ctx.nodes.get(node_id)
    try:
        status = await node.create_sandbox(spec)
    except NodeError as exc:
        await _creation_failed(ctx, record, exc)
        raise
    state = status.state.value
    await ctx.db.run(lambda s: repo.set_state(s, record.id, state, error=status.error))
    return replace(record, state=state, error=status.error)


async def _creation_failed(ctx: ControlContext, record: SandboxRecord, exc: NodeError) -> None:
    exc.sandbox_id = exc.sandbox_id or record.id
    error = f"{exc.code}: {exc.message}"
    await ctx.db.run(lambda s: repo.set_state(s, record.id, SandboxState.ERROR.value, error=error))
    # The node may have left a half-made VM behind; the row stays for the tenant to see.
    with contextlib.suppress(NodeError):
        await ctx.nodes.get(record.node_id).delete_sandbox(record.id)


async def delete_sandbox(ctx: ControlContext, record: SandboxRecord) -> None:
    """Delete a sandbox on its node and mark it deleted (idempotent).

    Raises ApiError(unavailable) if its node is not registered and the node's
    NodeError if the node fails; the row then keeps ``desired_state=deleted`` and a
    retry (or the reaper, or reconciliation) finishes the job.
    """
    if record.state == repo.DELETED:
        return
    await ctx.db.run(lambda s: repo.set_desired_deleted(s, record.id))
    node = ctx.nodes.get(record.node_id)
    with contextlib.suppress(NotFound):
        await node.delete_sandbox(record.id)
    now = ctx.clock()
    await ctx.db.run(lambda s: repo.mark_deleted(s, record.id, now))


async def pause_sandbox(ctx: ControlContext, record: SandboxRecord) -> SandboxRecord:
    """Pause a running sandbox on its node and record ``paused``; idempotent.

    Raises ApiError(conflict) naming the state for a sandbox neither running nor paused
    (nothing is asked of the node then), or the node's NodeError (the row unchanged).
    """
    _check_pausable("pause", record)
    status = await ctx.nodes.get(record.node_id).pause_sandbox(record.id)
    return await _record_status(ctx, record, status)


async def resume_sandbox(ctx: ControlContext, record: SandboxRecord) -> SandboxRecord:
    """Resume a paused sandbox on its node and record ``running``; idempotent.

    Raises as ``pause_sandbox``.
    """
    _check_pausable("resume", record)
    status = await ctx.nodes.get(record.node_id).resume_sandbox(record.id)
    return await _record_status(ctx, record, status)


def _check_pausable(operation: str, record: SandboxRecord) -> None:
    if record.state not in _PAUSABLE:
        raise ApiError(
            "conflict",
            f"cannot {operation} sandbox {record.id}: it is {record.state}",
            sandbox_id=record.id,
            state=record.state,
        )


async def _record_status(
    ctx: ControlContext, record: SandboxRecord, status: SandboxStatus
) -> SandboxRecord:
    state = status.state.value
    if state != record.state or status.error != record.error:
        await ctx.db.run(lambda s: repo.set_state(s, record.id, state, error=status.error))
    return replace(record, state=state, error=status.error)
