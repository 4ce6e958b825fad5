"""The quota check of every operation by which a tenant gains a resource (issue 17).

- creating sandboxes (create, from a snapshot or a template, and every child of a fork
  at once): the rows are inserted, then the tenant's use counted, in one transaction
  that is rolled back if a quota is exceeded, so a refusal stores nothing and two
  creates (even through two replicas) cannot both take the last place;
- waking a hibernated sandbox (resume, a guest operation, a restore) and hibernating a
  running one (by request or by the reaper: an idle sandbox past its tenant's
  ``suspended_sandboxes`` stays running): counted under the tenant's lock in this
  replica (which creates take too), held until the row records the node's answer, as
  the row changes only then;
- taking a snapshot: as creates, its pending row inserted then counted;
- building a template: a build slot taken before any byte of the context is read, and
  a build that would add a ``name:tag`` counted against ``templates`` before it starts.

Refusals are space.control.quotas' ApiError(resource_exhausted), 429.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from space.control.quotas import (
    BUILDS,
    DISK_MIB,
    MEMORY_MIB,
    QUOTAS,
    RUNNING_SANDBOXES,
    SNAPSHOTS,
    SUSPENDED_SANDBOXES,
    TEMPLATES,
    VCPUS,
    BuildSlot,
    QuotaLimits,
    check,
    refusal,
)
from space.control.store import quotas as store
from space.control.store import repo
from space.control.store import snapshots as snaps
from space.control.store.idempotency import claim as claim_key
from space.control.store.repo import SandboxRecord
from space.control.store.snapshots import SnapshotRecord
from space.control.template_names import BASE, tenant_name

if TYPE_CHECKING:
    from space.control.deps import ControlContext
    from space.control.idempotency import Idempotency

__all__ = [
    "check_new_template",
    "insert_sandboxes",
    "insert_snapshot",
    "limits",
    "quota_report",
    "suspending",
    "take_build",
    "tenant_templates",
    "waking",
]


def limits(session: Session, defaults: QuotaLimits, tenant: str) -> QuotaLimits:
    """The tenant's limits: ``defaults`` with its own overrides."""
    return defaults.with_overrides(store.overrides(session, tenant))


def _demand(records: Iterable[SandboxRecord]) -> dict[str, int]:
    """What new running sandboxes ask of each quota."""
    demand = dict.fromkeys((RUNNING_SANDBOXES.name, VCPUS.name, MEMORY_MIB.name, DISK_MIB.name), 0)
    for record in records:
        demand[RUNNING_SANDBOXES.name] += 1
        demand[VCPUS.name] += record.cpus
        demand[MEMORY_MIB.name] += record.memory_mib
        demand[DISK_MIB.name] += record.disk_mib
    return demand


def _check_counted(
    session: Session, defaults: QuotaLimits, tenant: str, demand: dict[str, int], operation: str
) -> None:
    """Check ``demand``, already written in this transaction, against the tenant's use."""
    store.lock_tenant(session, tenant)
    counted = store.usage(session, tenant)
    before = {name: counted.get(name, 0) - demand.get(name, 0) for name in counted}
    check(limits(session, defaults, tenant), before, demand, operation)


async def insert_sandboxes(
    ctx: ControlContext,
    records: Sequence[SandboxRecord],
    operation: str,
    idem: Idempotency | None = None,
) -> None:
    """Insert the rows of new sandboxes of one tenant (in ``creating``) if its quotas
    have room for them all; else raise the refusal and insert none. With ``idem``, its
    key is claimed in the same transaction (space.control.idempotency): KeyTaken, and
    nothing inserted, if another request holds it."""
    tenant = records[0].tenant_id
    demand = _demand(records)
    now = ctx.clock()

    def insert(session: Session) -> None:
        if idem is not None:
            claim_key(session, idem.record([r.id for r in records], now), now)
        for record in records:
            repo.insert_sandbox(session, record)
        session.flush()
        _check_counted(session, ctx.settings.quotas, tenant, demand, operation)

    # The tenant's lock too: a wake in this replica counts, then asks its node, then
    # writes its row; a create counted meanwhile would not see it.
    async with ctx.slots.move_lock(tenant):
        await ctx.db.run(insert)


def insert_snapshot(session: Session, defaults: QuotaLimits, pending: SnapshotRecord) -> None:
    """Insert a pending snapshot's row, in the caller's transaction, if its tenant's
    ``snapshots`` quota has room for it; else raise the refusal (the caller's
    transaction then rolls back: nothing inserted)."""
    snaps.insert_snapshot(session, pending)
    session.flush()
    _check_counted(session, defaults, pending.tenant_id, {SNAPSHOTS.name: 1}, "snapshot")


@contextlib.asynccontextmanager
async def waking(ctx: ControlContext, record: SandboxRecord, operation: str) -> AsyncIterator[None]:
    """The block wakes ``record`` and records its new state, if it is suspended: it runs
    under the tenant's lock, once the running quotas were found to have room (else the
    refusal is raised and the block does not run). A sandbox with a VM passes freely."""
    demand = _demand([record])
    del demand[DISK_MIB.name]  # a suspended sandbox holds its disk already
    async with _moving(ctx, record, store.HOLDS_VOLUME, demand, operation):
        yield


@contextlib.asynccontextmanager
async def suspending(
    ctx: ControlContext, record: SandboxRecord, operation: str
) -> AsyncIterator[None]:
    """The block hibernates ``record``: as ``waking``, against ``suspended_sandboxes``
    if it holds a VM now (a hibernated one passes freely)."""
    async with _moving(ctx, record, store.HOLDS_VM, {SUSPENDED_SANDBOXES.name: 1}, operation):
        yield


@contextlib.asynccontextmanager
async def _moving(
    ctx: ControlContext,
    record: SandboxRecord,
    sources: frozenset[str],
    demand: dict[str, int],
    operation: str,
) -> AsyncIterator[None]:
    # The row changes only once the node answers, so the count is held by the lock, not
    # by a row written first as creates do.
    if record.state not in sources:
        yield
        return

    def count(session: Session) -> None:
        used = store.usage(session, record.tenant_id)
        check(limits(session, ctx.settings.quotas, record.tenant_id), used, demand, operation)

    async with ctx.slots.move_lock(record.tenant_id):
        await ctx.db.run(count)
        yield


async def take_build(ctx: ControlContext, tenant: str) -> BuildSlot:
    """A build slot of ``tenant`` (release it when the build's stream ends); the
    refusal if its ``builds`` are all in flight. Reads no request body."""
    mine = await ctx.db.run(lambda s: limits(s, ctx.settings.quotas, tenant))
    return ctx.slots.take_build(tenant, mine.of(BUILDS))


async def tenant_templates(ctx: ControlContext, tenant: str) -> set[tuple[str, str]]:
    """The tenant's own ``(name, tag)`` pairs on every node that answers in time."""
    found: set[tuple[str, str]] = set()
    for node_id in ctx.nodes.ids():
        for info in await ctx.nodes.templates(node_id):
            name = tenant_name(tenant, info.name)
            if name is not None and name != BASE:
                found.add((name, info.tag))
    return found


async def check_new_template(ctx: ControlContext, tenant: str, name: str, tag: str) -> None:
    """Refuse a build that would add ``name:tag`` when the tenant's ``templates`` are
    all used (rebuilding an existing one adds none)."""
    existing = await tenant_templates(ctx, tenant)
    if (name, tag) in existing:
        return
    mine = await ctx.db.run(lambda s: limits(s, ctx.settings.quotas, tenant))
    if len(existing) + 1 > mine.of(TEMPLATES):
        raise refusal(TEMPLATES, mine.of(TEMPLATES), len(existing), 1, "build")


async def quota_report(ctx: ControlContext, tenant: str) -> dict[str, dict[str, Any]]:
    """Each quota of ``tenant``: its ``limit``, what is ``used`` and the ``unit``, in
    QUOTAS order (``GET /v1/quota``)."""

    def read(session: Session) -> tuple[QuotaLimits, dict[str, int]]:
        return limits(session, ctx.settings.quotas, tenant), store.usage(session, tenant)

    mine, used = await ctx.db.run(read)
    used[TEMPLATES.name] = len(await tenant_templates(ctx, tenant))
    used[BUILDS.name] = ctx.slots.builds(tenant)
    return {
        quota.name: {"limit": mine.of(quota), "used": used[quota.name], "unit": quota.unit}
        for quota in QUOTAS
    }
