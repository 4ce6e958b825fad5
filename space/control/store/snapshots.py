"""Queries on snapshots. Every tenant-facing lookup filters by tenant in SQL.

A snapshot row is ``pending`` while its node makes it, ``ready`` once the node
returned it (only ready rows are ever shown to tenants), ``deleting`` once deletion was
asked and ``deleted`` when the node confirmed. Functions take an open Session and
return frozen records.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from space.control.store.models import SandboxRow, SnapshotRow
from space.control.store.repo import retire_archive
from space.node.api import snapshot_archive

__all__ = [
    "DELETED",
    "DELETING",
    "PENDING",
    "READY",
    "SnapshotRecord",
    "drop_pending",
    "find_live_by_name",
    "find_snapshot",
    "insert_snapshot",
    "list_snapshots",
    "mark_deleted",
    "mark_deleting",
    "mark_ready",
    "on_node",
]

PENDING = "pending"
READY = "ready"
DELETING = "deleting"
DELETED = "deleted"


@dataclass(frozen=True, slots=True)
class SnapshotRecord:
    id: str
    tenant_id: str
    sandbox_id: str
    node_id: str
    name: str
    parent_id: str | None
    state: str
    created_at: float
    template: str
    cpus: int
    memory_mib: int
    disk_mib: int
    memory_bytes: int
    deleted_at: float | None = None
    #: Whether the artifact store holds it (it restores on any node then).
    archived: bool = False


def _record(row: SnapshotRow) -> SnapshotRecord:
    return SnapshotRecord(
        id=row.id,
        tenant_id=row.tenant_id,
        sandbox_id=row.sandbox_id,
        node_id=row.node_id,
        name=row.name,
        parent_id=row.parent_id,
        state=row.state,
        created_at=row.created_at,
        template=row.template,
        cpus=row.cpus,
        memory_mib=row.memory_mib,
        disk_mib=row.disk_mib,
        memory_bytes=row.memory_bytes,
        deleted_at=row.deleted_at,
        archived=row.archived,
    )


def insert_snapshot(session: Session, record: SnapshotRecord) -> None:
    session.add(
        SnapshotRow(
            id=record.id,
            tenant_id=record.tenant_id,
            sandbox_id=record.sandbox_id,
            node_id=record.node_id,
            name=record.name,
            parent_id=record.parent_id,
            state=record.state,
            created_at=record.created_at,
            deleted_at=record.deleted_at,
            template=record.template,
            cpus=record.cpus,
            memory_mib=record.memory_mib,
            disk_mib=record.disk_mib,
            memory_bytes=record.memory_bytes,
        )
    )


def find_snapshot(
    session: Session, tenant_id: str, snapshot_id: str, *, include_deleted: bool = False
) -> SnapshotRecord | None:
    """The tenant's ready snapshot (or deleting/deleted ones too), else None.

    Pending snapshots and other tenants' are exactly missing ones.
    """
    states = (READY, DELETING, DELETED) if include_deleted else (READY,)
    query = select(SnapshotRow).where(
        SnapshotRow.id == snapshot_id,
        SnapshotRow.tenant_id == tenant_id,
        SnapshotRow.state.in_(states),
    )
    row = session.scalars(query).one_or_none()
    return _record(row) if row else None


def find_live_by_name(session: Session, sandbox_id: str, name: str) -> SnapshotRecord | None:
    """A pending or ready snapshot called ``name`` of ``sandbox_id`` (name uniqueness)."""
    query = select(SnapshotRow).where(
        SnapshotRow.sandbox_id == sandbox_id,
        SnapshotRow.name == name,
        SnapshotRow.state.in_((PENDING, READY)),
    )
    row = session.scalars(query).first()
    return _record(row) if row else None


def list_snapshots(
    session: Session, tenant_id: str, *, sandbox_id: str | None = None
) -> list[SnapshotRecord]:
    """The tenant's ready snapshots (of one sandbox if given), oldest first."""
    query = select(SnapshotRow).where(
        SnapshotRow.tenant_id == tenant_id, SnapshotRow.state == READY
    )
    if sandbox_id is not None:
        query = query.where(SnapshotRow.sandbox_id == sandbox_id)
    query = query.order_by(SnapshotRow.created_at, SnapshotRow.id)
    return [_record(row) for row in session.scalars(query)]


def mark_ready(session: Session, record: SnapshotRecord) -> None:
    """Publish a pending snapshot with the node's answer, and make it its sandbox's head."""
    session.execute(
        update(SnapshotRow)
        .where(SnapshotRow.id == record.id, SnapshotRow.state == PENDING)
        .values(state=READY, parent_id=record.parent_id, memory_bytes=record.memory_bytes)
    )
    session.execute(
        update(SandboxRow).where(SandboxRow.id == record.sandbox_id).values(head_snapshot=record.id)
    )


def drop_pending(session: Session, snapshot_id: str) -> None:
    """Forget a snapshot the node never finished (it was never shown to anyone)."""
    session.execute(
        delete(SnapshotRow).where(SnapshotRow.id == snapshot_id, SnapshotRow.state == PENDING)
    )


def mark_deleting(session: Session, record: SnapshotRecord, now: float) -> None:
    """Hide a snapshot and re-parent, as the node will, its children and heads to its parent."""
    session.execute(
        update(SnapshotRow)
        .where(SnapshotRow.id == record.id)
        .values(state=DELETING, deleted_at=now)
    )
    session.execute(
        update(SnapshotRow)
        .where(SnapshotRow.parent_id == record.id)
        .values(parent_id=record.parent_id)
    )
    session.execute(
        update(SandboxRow)
        .where(SandboxRow.head_snapshot == record.id)
        .values(head_snapshot=record.parent_id)
    )


def mark_deleted(session: Session, snapshot_id: str) -> None:
    """A deleted snapshot's bundle in the artifact store goes stale with it."""
    archived = session.scalar(select(SnapshotRow.archived).where(SnapshotRow.id == snapshot_id))
    if archived:
        retire_archive(session, snapshot_archive(snapshot_id))
    session.execute(update(SnapshotRow).where(SnapshotRow.id == snapshot_id).values(state=DELETED))


def get_snapshot(session: Session, snapshot_id: str) -> SnapshotRecord | None:
    """Any tenant's snapshot row by id, whatever its state (for reconciliation)."""
    row = session.get(SnapshotRow, snapshot_id)
    return None if row is None else _record(row)


def on_node(session: Session, node_id: str) -> list[SnapshotRecord]:
    """Every snapshot row of ``node_id`` not yet deleted (for reconciliation)."""
    query = select(SnapshotRow).where(SnapshotRow.node_id == node_id, SnapshotRow.state != DELETED)
    return [_record(row) for row in session.scalars(query)]
