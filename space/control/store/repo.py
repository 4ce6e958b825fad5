"""Queries on sandboxes and nodes. Every tenant-facing lookup filters by tenant in SQL.

Functions take an open Session (see ``Database.run``) and return plain frozen
records, never ORM objects, so nothing touches the database outside its transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Table, bindparam, delete, func, or_, select, update
from sqlalchemy.orm import Session

from space.control.store.dialects import upsert
from space.control.store.models import SandboxRow, StaleArchiveRow
from space.node.api import SandboxState, SandboxStatus

__all__ = [
    "DELETED",
    "RUNNING",
    "SandboxRecord",
    "SecretBinding",
    "active_counts",
    "bound_to",
    "expired",
    "find_sandbox",
    "forget_sandbox",
    "idle",
    "insert_sandbox",
    "list_sandboxes",
    "mark_deleted",
    "mark_failed",
    "on_node",
    "sandbox_by_id",
    "set_desired_deleted",
    "set_egress",
    "set_node",
    "set_ports",
    "set_state",
    "set_status",
    "set_timeouts",
    "touch",
    "touch_many",
]

RUNNING = "running"
DELETED = "deleted"
#: States the reaper hibernates once idle (a hibernated one is idle already).
_IDLE_STATES = ("running", "paused")
#: States whose sandbox has a VM (or its saved state) and so a gateway with grants.
_GRANTED_STATES = ("running", "paused", "hibernated")


@dataclass(frozen=True, slots=True)
class SecretBinding:
    """A sandbox's use of one of its tenant's secrets: the guest holds ``placeholder`` in
    environment variable ``env`` (both fixed when the sandbox was made)."""

    name: str
    placeholder: str
    env: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "placeholder": self.placeholder, "env": self.env}


def _bindings(data: list[dict[str, str]] | None) -> tuple[SecretBinding, ...]:
    return tuple(SecretBinding(b["name"], b["placeholder"], b["env"]) for b in data or ())


@dataclass(frozen=True, slots=True)
class SandboxRecord:
    id: str
    tenant_id: str
    node_id: str
    template: str
    cpus: int
    memory_mib: int
    disk_mib: int
    env: dict[str, str]
    metadata: dict[str, Any]
    state: str
    desired_state: str
    created_at: float
    expires_at: float | None
    error: str | None = None
    deleted_at: float | None = None
    idle_timeout_s: int | None = None
    last_active_at: float | None = None
    head_snapshot: str | None = None
    #: The egress policy (canonical JSON); None: no network.
    egress: dict[str, Any] | None = None
    #: Its secret bindings (placeholders in its environment).
    secrets: tuple[SecretBinding, ...] = ()
    #: The artifact store's bundle holding it as it is now (space.control.archives).
    archive: str | None = None
    #: Port exposure: PORTS_OFF, PORTS_TOKEN or PORTS_PUBLIC (space.control.ports).
    ports: str = "off"
    #: The guest type (issue 21): as asked for (space.node.api.GUEST_CHOICES) until
    #: its node reports what ``auto`` resolved to (GUEST_TYPES).
    guest: str = "auto"

    @property
    def max_lifetime_s(self) -> int | None:
        """Seconds from creation to expiry (what the API calls ``max_lifetime_s``)."""
        return None if self.expires_at is None else round(self.expires_at - self.created_at)


def _record(row: SandboxRow) -> SandboxRecord:
    return SandboxRecord(
        id=row.id,
        tenant_id=row.tenant_id,
        node_id=row.node_id,
        template=row.template,
        cpus=row.cpus,
        memory_mib=row.memory_mib,
        disk_mib=row.disk_mib,
        env=dict(row.env),
        metadata=dict(row.meta),
        state=row.state,
        desired_state=row.desired_state,
        created_at=row.created_at,
        expires_at=row.expires_at,
        error=row.error,
        deleted_at=row.deleted_at,
        idle_timeout_s=row.idle_timeout_s,
        last_active_at=row.last_active_at,
        head_snapshot=row.head_snapshot,
        egress=None if row.egress is None else dict(row.egress),
        secrets=_bindings(row.secrets),
        archive=row.archive,
        ports=row.ports,
        guest=row.guest,
    )


def insert_sandbox(session: Session, record: SandboxRecord) -> None:
    session.add(
        SandboxRow(
            id=record.id,
            tenant_id=record.tenant_id,
            node_id=record.node_id,
            template=record.template,
            cpus=record.cpus,
            memory_mib=record.memory_mib,
            disk_mib=record.disk_mib,
            env=record.env,
            meta=record.metadata,
            state=record.state,
            desired_state=record.desired_state,
            created_at=record.created_at,
            expires_at=record.expires_at,
            idle_timeout_s=record.idle_timeout_s,
            last_active_at=record.last_active_at,
            head_snapshot=record.head_snapshot,
            egress=record.egress,
            secrets=[binding.to_json() for binding in record.secrets] or None,
            ports=record.ports,
            guest=record.guest,
        )
    )


def find_sandbox(
    session: Session, tenant_id: str, sandbox_id: str, *, include_deleted: bool = False
) -> SandboxRecord | None:
    """The tenant's sandbox, or None if it is missing, deleted, or another tenant's."""
    query = select(SandboxRow).where(SandboxRow.id == sandbox_id, SandboxRow.tenant_id == tenant_id)
    if not include_deleted:
        query = query.where(SandboxRow.state != DELETED)
    row = session.scalars(query).one_or_none()
    return _record(row) if row else None


def sandbox_by_id(session: Session, sandbox_id: str) -> SandboxRecord | None:
    """Any tenant's sandbox that is not deleted, or None. Only for requests a
    per-sandbox token authenticates (space.control.sandbox_traffic): the id names the
    sandbox and the token, checked next, proves the right to it."""
    query = select(SandboxRow).where(SandboxRow.id == sandbox_id, SandboxRow.state != DELETED)
    row = session.scalars(query).one_or_none()
    return _record(row) if row else None


def list_sandboxes(session: Session, tenant_id: str) -> list[SandboxRecord]:
    query = (
        select(SandboxRow)
        .where(SandboxRow.tenant_id == tenant_id, SandboxRow.state != DELETED)
        .order_by(SandboxRow.created_at, SandboxRow.id)
    )
    return [_record(row) for row in session.scalars(query)]


def set_state(session: Session, sandbox_id: str, state: str, *, error: str | None = None) -> None:
    session.execute(
        update(SandboxRow).where(SandboxRow.id == sandbox_id).values(state=state, error=error)
    )


def mark_failed(session: Session, sandbox_id: str, seen_state: str, error: str) -> bool:
    """Record a sandbox whose VM failed as ``error`` if its row still says ``seen_state``
    (an operation that changed it since wins); True if it did."""
    result = session.execute(
        update(SandboxRow)
        .where(SandboxRow.id == sandbox_id, SandboxRow.state == seen_state)
        .values(state=SandboxState.ERROR.value, error=error)
    )
    return bool(getattr(result, "rowcount", 0) == 1)


def set_status(session: Session, sandbox_id: str, status: SandboxStatus) -> None:
    """Record what the node reported of a sandbox; a bundle it no longer names goes
    on the stale list."""
    old = session.scalar(select(SandboxRow.archive).where(SandboxRow.id == sandbox_id))
    if old != status.archive:
        retire_archive(session, old)
    session.execute(
        update(SandboxRow)
        .where(SandboxRow.id == sandbox_id)
        .values(
            state=status.state.value,
            error=status.error,
            head_snapshot=status.head_snapshot,
            archive=status.archive,
            guest=status.guest,
        )
    )


def retire_archive(session: Session, name: str | None) -> None:
    """Put the bundle ``name`` on the stale list (nothing for None): no row names it
    any more, so the background job deletes it from the store (space.control.archives)."""
    if name is not None:
        upsert(session, StaleArchiveRow, {"name": name}, ["name"])


def set_node(session: Session, sandbox_id: str, node_id: str) -> None:
    """Place a sandbox that exists on no node yet (its create was refused) on another."""
    session.execute(update(SandboxRow).where(SandboxRow.id == sandbox_id).values(node_id=node_id))


def touch(session: Session, sandbox_id: str, now: float) -> None:
    """Record guest activity at ``now`` (never moves ``last_active_at`` backwards)."""
    session.execute(
        update(SandboxRow)
        .where(
            SandboxRow.id == sandbox_id,
            or_(SandboxRow.last_active_at.is_(None), SandboxRow.last_active_at < now),
        )
        .values(last_active_at=now)
    )


def touch_many(session: Session, marks: dict[str, float]) -> None:
    """``touch`` each sandbox of ``marks`` (id → time of its activity), in one batch."""
    if not marks:
        return
    # Core, not the ORM: one executemany of the statement (the ORM's bulk update by
    # primary key allows no further condition).
    table = cast(Table, SandboxRow.__table__)
    statement = (
        update(table)
        .where(
            table.c.id == bindparam("sandbox_id"),
            or_(table.c.last_active_at.is_(None), table.c.last_active_at < bindparam("at")),
        )
        .values(last_active_at=bindparam("at"))
    )
    session.execute(statement, [{"sandbox_id": k, "at": at} for k, at in marks.items()])


def set_timeouts(
    session: Session, sandbox_id: str, idle_timeout_s: int | None, expires_at: float | None
) -> None:
    session.execute(
        update(SandboxRow)
        .where(SandboxRow.id == sandbox_id)
        .values(idle_timeout_s=idle_timeout_s, expires_at=expires_at)
    )


def set_ports(session: Session, sandbox_id: str, mode: str) -> None:
    """Record who may reach the sandbox's ports (space.control.ports)."""
    session.execute(update(SandboxRow).where(SandboxRow.id == sandbox_id).values(ports=mode))


def set_egress(session: Session, sandbox_id: str, policy: dict[str, Any] | None) -> None:
    """Record a sandbox's egress policy (its desired state; None: no network)."""
    session.execute(update(SandboxRow).where(SandboxRow.id == sandbox_id).values(egress=policy))


def set_desired_deleted(session: Session, sandbox_id: str) -> None:
    session.execute(
        update(SandboxRow).where(SandboxRow.id == sandbox_id).values(desired_state=DELETED)
    )


def mark_deleted(session: Session, sandbox_id: str, now: float) -> None:
    retire_archive(
        session, session.scalar(select(SandboxRow.archive).where(SandboxRow.id == sandbox_id))
    )
    session.execute(
        update(SandboxRow)
        .where(SandboxRow.id == sandbox_id)
        .values(state=DELETED, desired_state=DELETED, deleted_at=now, archive=None)
    )


def forget_sandbox(session: Session, sandbox_id: str) -> None:
    """Remove the row of a sandbox that never existed (its create was refused)."""
    session.execute(delete(SandboxRow).where(SandboxRow.id == sandbox_id))


def expired(session: Session, now: float) -> list[SandboxRecord]:
    """Every tenant's sandboxes whose lifetime ended (for the reaper, not for tenants)."""
    query = select(SandboxRow).where(
        SandboxRow.expires_at.is_not(None),
        SandboxRow.expires_at <= now,
        SandboxRow.state != DELETED,
    )
    return [_record(row) for row in session.scalars(query)]


def idle(session: Session, now: float) -> list[SandboxRecord]:
    """Every tenant's running or paused sandboxes idle for their ``idle_timeout_s``.

    Idle since the last activity, or since creation if there was none; due exactly at
    the boundary (``last + idle_timeout_s <= now``), as expiry is. For the reaper.
    """
    since = func.coalesce(SandboxRow.last_active_at, SandboxRow.created_at)
    query = select(SandboxRow).where(
        SandboxRow.idle_timeout_s.is_not(None),
        SandboxRow.state.in_(_IDLE_STATES),
        SandboxRow.desired_state == RUNNING,
        since + SandboxRow.idle_timeout_s <= now,
    )
    return [_record(row) for row in session.scalars(query)]


def on_node(session: Session, node_id: str) -> list[SandboxRecord]:
    """Every sandbox placed on ``node_id`` that is not deleted (for reconciliation)."""
    query = select(SandboxRow).where(SandboxRow.node_id == node_id, SandboxRow.state != DELETED)
    return [_record(row) for row in session.scalars(query)]


def bound_to(session: Session, tenant_id: str, name: str) -> list[SandboxRecord]:
    """The tenant's sandboxes with a VM (running, paused, hibernated) bound to secret
    ``name``. Bindings are JSON: filtered here, portably, not in SQL."""
    query = select(SandboxRow).where(
        SandboxRow.tenant_id == tenant_id,
        SandboxRow.state.in_(_GRANTED_STATES),
    )
    records = [_record(row) for row in session.scalars(query)]
    return [r for r in records if any(b.name == name for b in r.secrets)]


def active_counts(session: Session) -> dict[str, int]:
    """Sandboxes per node that are not deleted (placement's load measure)."""
    query = (
        select(SandboxRow.node_id, func.count())
        .where(SandboxRow.state != DELETED)
        .group_by(SandboxRow.node_id)
    )
    return {node_id: count for node_id, count in session.execute(query)}
