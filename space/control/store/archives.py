"""The rows that follow the artifact store's bundles (issue 19; space.control.archives).

A bundle stops being named (a sandbox changed or was deleted, its node replaced it, a
snapshot was deleted) in the same transaction that says so, and goes on the stale list
then; the background job deletes it from the store and forgets it. So nothing a row
names is ever deleted, and nothing unnamed is left for good.
"""

from __future__ import annotations

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from space.control.store.models import SandboxRow, SnapshotRow, StaleArchiveRow
from space.control.store.repo import DELETED, SandboxRecord, _record, retire_archive
from space.node.api import SandboxState, snapshot_archive

__all__ = [
    "forget_stale",
    "hibernated_unarchived",
    "lost_archived",
    "mark_snapshot_archived",
    "name_archive",
    "rehome_lost",
    "set_archive",
    "stale",
    "unarchived_snapshots",
]

_HIBERNATED = SandboxState.HIBERNATED.value
_LOST = SandboxState.LOST.value


def set_archive(session: Session, sandbox_id: str, archive: str | None) -> None:
    """Name ``archive`` as the sandbox's bundle; the one it named before goes stale."""
    old = session.scalar(select(SandboxRow.archive).where(SandboxRow.id == sandbox_id))
    if old == archive:
        return
    retire_archive(session, old)
    session.execute(update(SandboxRow).where(SandboxRow.id == sandbox_id).values(archive=archive))


def name_archive(session: Session, record: SandboxRecord, archive: str) -> bool:
    """Name ``archive`` as the bundle of the sandbox ``record`` if its row still says it
    is hibernated on the node that uploaded it, naming none; else the bundle is stale
    at once. True if named."""
    result = session.execute(
        update(SandboxRow)
        .where(
            SandboxRow.id == record.id,
            SandboxRow.node_id == record.node_id,
            SandboxRow.state == _HIBERNATED,
            SandboxRow.archive.is_(None),
        )
        .values(archive=archive)
    )
    named = bool(getattr(result, "rowcount", 0) == 1)
    if not named:
        retire_archive(session, archive)
    return named


def stale(session: Session, limit: int) -> list[str]:
    return list(
        session.scalars(select(StaleArchiveRow.name).order_by(StaleArchiveRow.name).limit(limit))
    )


def forget_stale(session: Session, name: str) -> None:
    session.execute(delete(StaleArchiveRow).where(StaleArchiveRow.name == name))


def hibernated_unarchived(session: Session, node_id: str) -> list[SandboxRecord]:
    """The node's hibernated sandboxes no bundle holds yet."""
    query = select(SandboxRow).where(
        SandboxRow.node_id == node_id,
        SandboxRow.state == _HIBERNATED,
        SandboxRow.desired_state != DELETED,
        SandboxRow.archive.is_(None),
    )
    return [_record(row) for row in session.scalars(query)]


def unarchived_snapshots(session: Session, node_id: str) -> list[str]:
    """The ids of the node's published snapshots the store does not hold yet."""
    query = select(SnapshotRow.id).where(
        SnapshotRow.node_id == node_id,
        SnapshotRow.state == "ready",
        SnapshotRow.archived.is_(False),
    )
    return list(session.scalars(query))


def mark_snapshot_archived(session: Session, snapshot_id: str) -> None:
    """The store holds the snapshot now; if it was deleted meanwhile, its bundle is stale."""
    session.execute(update(SnapshotRow).where(SnapshotRow.id == snapshot_id).values(archived=True))
    state = session.scalar(select(SnapshotRow.state).where(SnapshotRow.id == snapshot_id))
    if state is None or state == DELETED:
        retire_archive(session, snapshot_archive(snapshot_id))


def lost_archived(session: Session) -> list[SandboxRecord]:
    """Lost sandboxes a bundle holds as they were: each can be woken on another node."""
    query = select(SandboxRow).where(
        SandboxRow.state == _LOST,
        SandboxRow.desired_state != DELETED,
        SandboxRow.archive.is_not(None),
    )
    return [_record(row) for row in session.scalars(query)]


def rehome_lost(session: Session, record: SandboxRecord, node_id: str) -> bool:
    """Move the lost sandbox ``record`` to ``node_id``, hibernated, if its row is still
    as read (lost, on its old node, naming the same bundle); True if it did."""
    result = session.execute(
        update(SandboxRow)
        .where(
            SandboxRow.id == record.id,
            SandboxRow.node_id == record.node_id,
            SandboxRow.state == _LOST,
            SandboxRow.archive == record.archive,
        )
        .values(node_id=node_id, state=_HIBERNATED, error=None)
    )
    return bool(getattr(result, "rowcount", 0) == 1)
