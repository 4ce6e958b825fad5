"""Sandbox creation and deletion: desired state is recorded before a node is asked.

Both are safe to retry: create writes its row (``creating``) before calling the node,
so a crash mid-way leaves a row that reconciliation settles; delete records
``desired_state=deleted`` first, tolerates a node that no longer knows the sandbox,
and does nothing for a sandbox already deleted.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
from dataclasses import replace
from typing import Any

from sqlalchemy.orm import Session

from space.control import broker, egress, idempotency, ports, quota_checks
from space.control.archived import fetch_snapshot, snapshot_nodes
from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.idempotency import Idempotency
from space.control.node_text import scrub
from space.control.scheduler import rank_nodes
from space.control.schemas import SandboxCreate
from space.control.store import nodes as node_rows
from space.control.store import repo
from space.control.store import snapshots as snaps
from space.control.store.repo import SandboxRecord, SecretBinding
from space.control.store.snapshots import SnapshotRecord
from space.control.template_names import node_name, node_ref, parse_ref
from space.node.api import (
    InsufficientCapacity,
    NodeError,
    NodeService,
    NotFound,
    SandboxSpec,
    SandboxState,
    SandboxStatus,
)

__all__ = [
    "LIVE",
    "check_state",
    "create_sandbox",
    "delete_sandbox",
    "hibernate_sandbox",
    "new_sandbox_id",
    "pause_sandbox",
    "record_status",
    "resume_sandbox",
    "set_timeouts",
]

#: The states pause accepts (pausing a paused sandbox is a no-op).
#: What a template gives a sandbox that does not ask for it.
_RESOURCES = frozenset({"cpus", "memory_mib", "disk_mib"})
_PAUSABLE = frozenset({SandboxState.RUNNING.value, SandboxState.PAUSED.value})
#: States with a VM whose guest state exists: hibernate, resume, snapshot, fork and
#: restore accept them.
LIVE = frozenset({*_PAUSABLE, SandboxState.HIBERNATED.value})
_SUSPENDABLE = LIVE
#: Node errors that refuse a create as asked (the request's fault, or a limit): the
#: sandbox never existed, so no row is kept. Any other error (the node failed) keeps
#: the row in ``error`` for the tenant to see.
_REFUSALS = frozenset(
    {"not_found", "invalid_argument", "conflict", "permission_denied", "resource_exhausted"}
)

log = logging.getLogger(__name__)


def new_sandbox_id() -> str:
    """An unguessable sandbox id (96 random bits) the node's id rules accept."""
    return "sb-" + secrets.token_hex(12)


async def _place(ctx: ControlContext, template: str, guest: str = "auto") -> list[str]:
    """The nodes to ask for a new sandbox of the node's ``template`` name and guest
    type, in order (space.control.scheduler; ApiError(unavailable) if none is active)."""

    def read(session: Session) -> tuple[list[node_rows.NodeRecord], dict[str, int]]:
        return node_rows.list_nodes(session), repo.active_counts(session)

    records, load = await ctx.db.read(read)  # advisory: no common snapshot needed
    nodes = rank_nodes(records, load, reachable=ctx.nodes.ids(), template=template, guest=guest)
    if not nodes:
        raise ApiError("unavailable", f"no node is registered and active to run {guest} sandboxes")
    return nodes


async def _source(
    ctx: ControlContext, tenant: str, snapshot_id: str | None
) -> SnapshotRecord | None:
    if snapshot_id is None:
        return None
    found = await ctx.db.run(lambda s: snaps.find_snapshot(s, tenant, snapshot_id))
    if found is None:
        raise ApiError("not_found", f"no snapshot {snapshot_id!r}", snapshot_id=snapshot_id)
    return found


def _new_record(
    ctx: ControlContext,
    tenant: str,
    node_id: str,
    body: SandboxCreate,
    source: SnapshotRecord | None,
    timeout_s: int | None,
    policy: dict[str, Any] | None,
    bindings: tuple[SecretBinding, ...],
) -> SandboxRecord:
    now = ctx.clock()
    shape = source or body  # template and resources
    return SandboxRecord(
        id=new_sandbox_id(),
        tenant_id=tenant,
        node_id=node_id,
        template=shape.template,
        cpus=shape.cpus,
        memory_mib=shape.memory_mib,
        disk_mib=shape.disk_mib,
        env=dict(body.env),
        metadata=dict(body.metadata),
        state=SandboxState.CREATING.value,
        desired_state=repo.RUNNING,
        created_at=now,
        expires_at=None if timeout_s is None else now + timeout_s,
        idle_timeout_s=body.idle_timeout_s,
        head_snapshot=None if source is None else source.id,
        egress=policy,
        secrets=bindings,
        guest=body.guest,
    )


def _spec(record: SandboxRecord, from_snapshot: str | None = None) -> SandboxSpec:
    return SandboxSpec(
        sandbox_id=record.id,
        # The tenant's spelling is kept in the row; the node knows the scoped name.
        template=node_ref(record.tenant_id, record.template),
        cpus=record.cpus,
        memory_mib=record.memory_mib,
        disk_mib=record.disk_mib,
        # Every exec sees the placeholders; the values stay with the node's gateway.
        env={**record.env, **broker.placeholder_env(record.secrets)},
        from_snapshot=from_snapshot,
        egress=record.egress,
        guest=record.guest,
    )


async def create_sandbox(
    ctx: ControlContext,
    tenant: str,
    body: SandboxCreate,
    *,
    timeout_given: bool,
    idem: Idempotency | None = None,
) -> SandboxRecord:
    """Record, place and start a sandbox (from a snapshot if asked); returns it running.

    Idempotent with ``idem``: a retry gets the sandbox the first request made, as it is
    now (space.control.idempotency, which also says what else it raises).

    A sandbox made from a snapshot goes to the snapshot's node (or, if it is lost or
    full and the artifact store holds the snapshot, to another that copies it from
    there: space.control.archived) and takes its template
    and resources, and the egress policy and secret bindings its sandbox has now unless
    ``body`` gives them. Once the node runs it, its secret grants are sent.
    Raises ApiError(invalid_argument) for a malformed egress policy or an unknown
    secret (nothing recorded), ApiError(resource_exhausted) when it would take the
    tenant past a quota (nothing recorded, no node asked), ApiError(not_found) for a
    snapshot that is not the tenant's, ApiError(unavailable) with no node,
    InsufficientCapacity when no node has room (each asked in ``_place``'s order; the
    row is then deleted: the sandbox never existed; a node without the template, not
    shipped there yet, passes it on too), the node's refusal of the request
    (not_found for an unknown template, invalid_argument, conflict, permission_denied,
    resource_exhausted: no row is kept, and the message names no node-internal template
    name), or another
    NodeError of the node (with the new sandbox's id in its details, the row then in
    state ``error``); a failure to send its grants also leaves the row in ``error``
    and deletes it on the node. Cancelled mid-way, the row stays ``creating`` until
    reconciliation.
    """

    async def make(claim: Idempotency | None) -> list[SandboxRecord]:
        return [await _create(ctx, tenant, body, timeout_given, claim)]

    (record,) = await idempotency.once(ctx, idem, make)
    return record


async def _create(
    ctx: ControlContext,
    tenant: str,
    body: SandboxCreate,
    timeout_given: bool,
    idem: Idempotency | None,
) -> SandboxRecord:
    given = (
        None if body.egress is None else egress.canonical(body.egress, ctx.settings.egress_bounds)
    )
    source = await _source(ctx, tenant, body.from_snapshot)
    node_ref(tenant, body.template)  # refuse a name too long to scope before any row
    parent = await _source_sandbox(ctx, source)
    bindings = await _bindings(ctx, tenant, body, parent)
    # A sandbox from a snapshot runs where the snapshot is, or where the store has it.
    if source is not None:
        nodes = await snapshot_nodes(ctx, source)
    else:
        nodes = await _place(ctx, node_name(tenant, parse_ref(body.template).name), body.guest)
    timeout_s = body.timeout_s if timeout_given else ctx.settings.default_timeout_s
    if source is None:
        body = await _with_template_defaults(ctx.nodes.get(nodes[0]), tenant, body)
    inherited = None if parent is None else parent.egress
    policy = given if "egress" in body.model_fields_set else inherited
    record = _new_record(ctx, tenant, nodes[0], body, source, timeout_s, policy, bindings)
    if body.ports is not None:
        record = replace(record, ports=ports.mode_of(body.ports))
    elif parent is not None:
        record = replace(record, ports=parent.ports)
    await quota_checks.insert_sandboxes(ctx, [record], "create", idem)
    record = await _start(ctx, record, nodes, source)
    if record.secrets:
        await _send_grants(ctx, record)
    return record


async def _start(
    ctx: ControlContext, record: SandboxRecord, nodes: list[str], source: SnapshotRecord | None
) -> SandboxRecord:
    """Create the recorded sandbox (from ``source``) on the first of ``nodes`` that has
    room; the row follows it there. Raises as ``create_sandbox``."""
    from_snapshot = None if source is None else source.id
    sandbox_id = record.id
    refusals: list[InsufficientCapacity] = []
    for node_id in nodes:
        if node_id != record.node_id:  # nothing of it exists on the node that refused
            record = replace(record, node_id=node_id)
            await ctx.db.run(
                functools.partial(repo.set_node, sandbox_id=sandbox_id, node_id=node_id)
            )
        try:
            if source is not None:
                await fetch_snapshot(ctx, source, node_id)
            node = ctx.nodes.get(node_id)
            with ctx.metrics.timing_create("template" if source is None else "snapshot"):
                status = await node.create_sandbox(_spec(record, from_snapshot))
        except InsufficientCapacity as exc:
            log.info("node %s has no room for sandbox %s: %s", node_id, record.id, exc)
            refusals.append(exc)
            continue
        except NotFound as exc:
            if from_snapshot is not None or node_id == nodes[-1]:
                await _creation_refused(ctx, record)
                exc.message, exc.sandbox_id = scrub(exc.message), None
                raise
            # Its template is not shipped there yet (space.control.shipping).
            log.info("node %s cannot make sandbox %s: %s", node_id, record.id, exc)
            continue
        except NodeError as exc:
            exc.message = scrub(exc.message)  # it is kept as the row's error too
            if exc.code in _REFUSALS:
                exc.sandbox_id = None  # nothing by that id exists
                await _creation_refused(ctx, record)
            else:
                await _creation_failed(ctx, record, exc)
            raise
        return await record_status(ctx, record, status)
    await ctx.db.run(lambda s: repo.forget_sandbox(s, sandbox_id))
    raise _no_room(refusals)


def _no_room(refusals: list[InsufficientCapacity]) -> InsufficientCapacity:
    """What a client hears when every node refused: the last node's refusal (and how
    many nodes were asked), naming no sandbox: none was made."""
    last = refusals[-1]
    many = f"none of the {len(refusals)} nodes has room; the last: " if len(refusals) > 1 else ""
    return InsufficientCapacity(
        many + last.message,
        resource=last.resource,
        needed=last.needed,
        available=last.available,
        unit=last.unit,
        retry_after_s=last.retry_after_s,
    )


async def _bindings(
    ctx: ControlContext, tenant: str, body: SandboxCreate, parent: SandboxRecord | None
) -> tuple[SecretBinding, ...]:
    """The new sandbox's secret bindings: the body's, else (from a snapshot) those of the
    snapshot's sandbox. Raises ApiError(invalid_argument) as broker.bind."""
    inherited = () if parent is None else parent.secrets
    given = "secrets" in body.model_fields_set or parent is None
    return await broker.bind(ctx, tenant, body.secrets if given else None, inherited, body.env)


async def _send_grants(ctx: ControlContext, record: SandboxRecord) -> None:
    """Push a new sandbox's grants; if that fails, it is an error (deleted on its node):
    a sandbox running without the secrets it was made with would fail obscurely."""
    try:
        await broker.push(ctx, record)
    except NodeError as exc:
        await _creation_failed(ctx, record, exc)
        raise
    except ApiError as exc:
        exc.details.setdefault("sandbox_id", record.id)
        await _failed(ctx, record, f"{exc.code}: {exc.message}")
        raise


async def _source_sandbox(
    ctx: ControlContext, source: SnapshotRecord | None
) -> SandboxRecord | None:
    """The snapshot's sandbox as it is now (its row outlives it); None without one."""
    if source is None:
        return None
    return await ctx.db.run(
        lambda s: repo.find_sandbox(s, source.tenant_id, source.sandbox_id, include_deleted=True)
    )


async def _with_template_defaults(
    node: NodeService, tenant: str, body: SandboxCreate
) -> SandboxCreate:
    """``body`` with the resources it leaves out taken from its template's defaults
    (so its sandboxes start from the template's ready state). ``base`` has the API's."""
    missing = _RESOURCES - body.model_fields_set
    ref = parse_ref(body.template)
    if not missing or ref.name == "base":
        return body
    wanted = parse_ref(node_ref(tenant, body.template))
    for info in await node.list_templates():
        tagged = wanted.tag in (None, info.tag) and wanted.digest in (None, info.digest)
        if info.name == wanted.name and tagged:
            return body.model_copy(update={k: getattr(info, k) for k in missing})
    return body  # the node answers not_found on create


async def _creation_refused(ctx: ControlContext, record: SandboxRecord) -> None:
    """The node refused the request itself: nothing of the sandbox is kept (issue 17: a
    refused create stored its env and metadata in an ``error`` row)."""
    await ctx.db.run(lambda s: repo.forget_sandbox(s, record.id))
    with contextlib.suppress(NodeError):
        await ctx.nodes.get(record.node_id).delete_sandbox(record.id)


async def _creation_failed(ctx: ControlContext, record: SandboxRecord, exc: NodeError) -> None:
    exc.sandbox_id = exc.sandbox_id or record.id
    await _failed(ctx, record, f"{exc.code}: {exc.message}")


async def _failed(ctx: ControlContext, record: SandboxRecord, error: str) -> None:
    await ctx.db.run(lambda s: repo.set_state(s, record.id, SandboxState.ERROR.value, error=error))
    # The node may have left a half-made VM behind; the row stays for the tenant to see.
    with contextlib.suppress(NodeError):
        await ctx.nodes.get(record.node_id).delete_sandbox(record.id)


async def delete_sandbox(ctx: ControlContext, record: SandboxRecord) -> None:
    """Delete a sandbox on its node and mark it deleted (idempotent).

    Raises ApiError(unavailable) if its node is not registered and the node's
    NodeError if the node fails; the row then keeps ``desired_state=deleted`` and a
    retry (or the reaper, or reconciliation) finishes the job. A ``lost`` sandbox is
    marked deleted without asking its node: if the node comes back, reconciliation
    deletes what it still has (no row claims it).
    """
    if record.state == repo.DELETED:
        return
    await ctx.db.run(lambda s: repo.set_desired_deleted(s, record.id))
    if record.state != SandboxState.LOST.value:
        with contextlib.suppress(NotFound):
            await ctx.nodes.get(record.node_id).delete_sandbox(record.id)
    now = ctx.clock()
    await ctx.db.run(lambda s: repo.mark_deleted(s, record.id, now))


async def pause_sandbox(ctx: ControlContext, record: SandboxRecord) -> SandboxRecord:
    """Pause a running sandbox on its node and record ``paused``; idempotent.

    Raises ApiError(conflict) naming the state for a sandbox neither running nor paused
    (nothing is asked of the node then), or the node's NodeError (the row unchanged).
    """
    check_state("pause", record, _PAUSABLE)
    status = await ctx.nodes.get(record.node_id).pause_sandbox(record.id)
    return await record_status(ctx, record, status)


async def hibernate_sandbox(ctx: ControlContext, record: SandboxRecord) -> SandboxRecord:
    """Save a running or paused sandbox's memory to disk, freeing its RAM; idempotent.

    Raises as ``pause_sandbox`` (409 unless running, paused or hibernated), or
    ApiError(resource_exhausted) past its tenant's ``suspended_sandboxes`` (nothing
    asked of the node).
    """
    check_state("hibernate", record, _SUSPENDABLE)
    async with quota_checks.suspending(ctx, record, "hibernate"):
        status = await ctx.nodes.get(record.node_id).hibernate_sandbox(record.id)
        return await record_status(ctx, record, status)


async def resume_sandbox(ctx: ControlContext, record: SandboxRecord) -> SandboxRecord:
    """Resume a paused or hibernated sandbox, record ``running`` and mark it active.

    Idempotent. Raises as ``pause_sandbox`` (409 unless running, paused or hibernated),
    or ApiError(resource_exhausted) for a hibernated one its tenant's running quotas
    have no room for (nothing asked of the node). Marking it active keeps the reaper
    from hibernating it again at once.
    """
    check_state("resume", record, _SUSPENDABLE)
    async with quota_checks.waking(ctx, record, "resume"):
        status = await ctx.nodes.get(record.node_id).resume_sandbox(record.id)
        return await record_status(ctx, record, status, active=True)


async def set_timeouts(
    ctx: ControlContext, record: SandboxRecord, changes: dict[str, int | None]
) -> SandboxRecord:
    """Change ``idle_timeout_s`` and/or ``max_lifetime_s`` (keys absent: unchanged).

    ``max_lifetime_s`` counts from creation, so one shorter than the sandbox's age makes
    the reaper delete it at its next round. Takes effect at the reaper's next round.
    """
    idle = changes.get("idle_timeout_s", record.idle_timeout_s)
    lifetime = changes.get("max_lifetime_s", record.max_lifetime_s)
    expires_at = None if lifetime is None else record.created_at + lifetime
    await ctx.db.run(lambda s: repo.set_timeouts(s, record.id, idle, expires_at))
    return replace(record, idle_timeout_s=idle, expires_at=expires_at)


def check_state(operation: str, record: SandboxRecord, allowed: frozenset[str]) -> None:
    """Raise ApiError(conflict) naming the state unless ``record`` is in ``allowed``."""
    if record.state not in allowed:
        raise ApiError(
            "conflict",
            f"cannot {operation} sandbox {record.id}: it is {record.state}",
            sandbox_id=record.id,
            state=record.state,
        )


async def record_status(
    ctx: ControlContext, record: SandboxRecord, status: SandboxStatus, *, active: bool = False
) -> SandboxRecord:
    """Store what the node reported (state, error, head snapshot, archive, the guest
    type ``auto`` resolved to); with ``active``, mark the sandbox active now too.
    Returns the updated record."""
    now = ctx.clock()
    new = replace(
        record,
        state=status.state.value,
        guest=status.guest,
        error=status.error,
        head_snapshot=status.head_snapshot,
        archive=status.archive,
        last_active_at=now if active else record.last_active_at,
    )

    def store(session: Session) -> None:
        repo.set_status(session, new.id, status)
        if active:
            repo.touch(session, new.id, now)

    if new != record:
        await ctx.db.run(store)
    return new
