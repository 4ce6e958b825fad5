"""Queries behind the quotas (space.control.quotas): a tenant's overrides and its use.

What counts where is decided here, once, by sandbox state: ``HOLDS_VM`` states count as
running sandboxes (their vCPUs and memory too), ``HOLDS_VOLUME`` states as suspended
ones, and both hold disk. Functions take an open Session.
"""

from __future__ import annotations

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from space.control.quotas import (
    DISK_MIB,
    MEMORY_MIB,
    RUNNING_SANDBOXES,
    SNAPSHOTS,
    SUSPENDED_SANDBOXES,
    VCPUS,
)
from space.control.store import snapshots as snaps
from space.control.store.dialects import upsert
from space.control.store.models import SandboxRow, SnapshotRow, TenantQuotaRow, TenantRow
from space.node.api import SandboxState

__all__ = [
    "HOLDS_VM",
    "HOLDS_VOLUME",
    "lock_tenant",
    "overrides",
    "reset_limits",
    "set_limit",
    "tenant_exists",
    "usage",
]

#: States whose sandbox holds a VM (or is starting one).
HOLDS_VM = frozenset(
    {SandboxState.CREATING.value, SandboxState.RUNNING.value, SandboxState.PAUSED.value}
)
#: States whose sandbox holds only its volume on a node: its state saved, no VM.
HOLDS_VOLUME = frozenset({SandboxState.HIBERNATED.value, SandboxState.STOPPED.value})
#: Snapshot states that count: being taken, or listed.
_COUNTED_SNAPSHOTS = (snaps.PENDING, snaps.READY)


def tenant_exists(session: Session, tenant: str) -> bool:
    return session.get(TenantRow, tenant) is not None


def lock_tenant(session: Session, tenant: str) -> None:
    """Serialise the quota checks (and name claims) of ``tenant`` until the transaction
    ends, the same on both backends.

    On PostgreSQL a row lock on the tenant (``FOR NO KEY UPDATE``, which the foreign-key
    checks of the rows being inserted do not wait for): a second replica's check waits,
    then counts what the first committed. SQLite has no row locks: a write that changes
    nothing takes its database-wide write lock, which a second writer waits for (its
    busy timeout), so what this transaction reads next no other writer changes.
    """
    if session.get_bind().dialect.name == "sqlite":
        session.execute(update(TenantRow).where(TenantRow.id == tenant).values(id=TenantRow.id))
        return
    session.execute(
        select(TenantRow.id).where(TenantRow.id == tenant).with_for_update(key_share=True)
    )


def overrides(session: Session, tenant: str) -> dict[str, int]:
    """The tenant's own limits: quota name → limit (quotas left at the default absent)."""
    query = select(TenantQuotaRow).where(TenantQuotaRow.tenant_id == tenant)
    return {row.quota: row.limit for row in session.scalars(query)}


def set_limit(session: Session, tenant: str, quota: str, limit: int, now: float) -> None:
    """Give ``tenant`` its own ``limit`` of ``quota`` (replacing any earlier one)."""
    values = {"tenant_id": tenant, "quota": quota, "limit": limit, "updated_at": now}
    upsert(session, TenantQuotaRow, values, ["tenant_id", "quota"], ["limit", "updated_at"])


def reset_limits(session: Session, tenant: str, quotas: frozenset[str] | None = None) -> None:
    """Put ``quotas`` (all if None) of ``tenant`` back to the defaults."""
    stmt = delete(TenantQuotaRow).where(TenantQuotaRow.tenant_id == tenant)
    if quotas is not None:
        stmt = stmt.where(TenantQuotaRow.quota.in_(sorted(quotas)))
    session.execute(stmt)


def usage(session: Session, tenant: str) -> dict[str, int]:
    """What ``tenant`` holds of every quota the database knows (all but templates and
    builds): quota name → amount."""
    held = select(
        SandboxRow.state, func.count(), func.sum(SandboxRow.cpus),
        func.sum(SandboxRow.memory_mib), func.sum(SandboxRow.disk_mib),
    ).where(
        SandboxRow.tenant_id == tenant, SandboxRow.state.in_(HOLDS_VM | HOLDS_VOLUME)
    ).group_by(SandboxRow.state)  # fmt: skip
    quotas = (RUNNING_SANDBOXES, SUSPENDED_SANDBOXES, VCPUS, MEMORY_MIB, DISK_MIB)
    used = {quota.name: 0 for quota in quotas}
    for state, count, cpus, memory_mib, disk_mib in session.execute(held):
        if state in HOLDS_VM:
            used[RUNNING_SANDBOXES.name] += count
            used[VCPUS.name] += cpus or 0
            used[MEMORY_MIB.name] += memory_mib or 0
        else:
            used[SUSPENDED_SANDBOXES.name] += count
        used[DISK_MIB.name] += disk_mib or 0
    counted = (
        select(func.count())
        .select_from(SnapshotRow)
        .where(SnapshotRow.tenant_id == tenant, SnapshotRow.state.in_(_COUNTED_SNAPSHOTS))
    )
    used[SNAPSHOTS.name] = session.execute(counted).scalar_one()
    return used
