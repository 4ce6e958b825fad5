"""Queries on idempotency keys (issue 19). Every lookup filters by tenant in SQL.

A key's row is inserted in the transaction that inserts its sandboxes' rows, so the
two exist together or not at all; its primary key (tenant, key) makes a second insert
fail on both backends (PostgreSQL makes it wait for the first transaction's outcome,
SQLite for its write lock), which ``claim`` answers with KeyTaken. Functions take an
open Session.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, exc, select
from sqlalchemy.orm import Session

from space.control.store.models import IdempotencyKeyRow

__all__ = ["IdempotencyRecord", "KeyTaken", "claim", "find", "release", "sweep"]


class KeyTaken(Exception):
    """Another request holds this (tenant, key): read what it made (``find``)."""


@dataclass(frozen=True, slots=True)
class IdempotencyRecord:
    tenant_id: str
    key: str
    request_hash: str
    sandbox_ids: tuple[str, ...]
    expires_at: float


def _record(row: IdempotencyKeyRow) -> IdempotencyRecord:
    return IdempotencyRecord(
        row.tenant_id, row.key, row.request_hash, tuple(row.sandbox_ids), row.expires_at
    )


def claim(session: Session, record: IdempotencyRecord, now: float) -> None:
    """Insert ``record`` (an expired row of its key replaced) in the caller's
    transaction; KeyTaken if a live row of its key exists (the transaction is then
    unusable: let the exception end it)."""
    session.execute(
        delete(IdempotencyKeyRow).where(
            IdempotencyKeyRow.tenant_id == record.tenant_id,
            IdempotencyKeyRow.key == record.key,
            IdempotencyKeyRow.expires_at <= now,
        )
    )
    session.add(
        IdempotencyKeyRow(
            tenant_id=record.tenant_id,
            key=record.key,
            request_hash=record.request_hash,
            sandbox_ids=list(record.sandbox_ids),
            created_at=now,
            expires_at=record.expires_at,
        )
    )
    try:
        session.flush()
    except exc.IntegrityError:
        raise KeyTaken(record.key) from None


def find(session: Session, tenant_id: str, key: str, now: float) -> IdempotencyRecord | None:
    """The tenant's live row of ``key``, or None (expired rows are none)."""
    row = session.scalars(
        select(IdempotencyKeyRow).where(
            IdempotencyKeyRow.tenant_id == tenant_id,
            IdempotencyKeyRow.key == key,
            IdempotencyKeyRow.expires_at > now,
        )
    ).one_or_none()
    return _record(row) if row else None


def release(session: Session, record: IdempotencyRecord) -> None:
    """Forget ``record``'s key (only that request's row), so a retry makes its sandboxes."""
    session.execute(
        delete(IdempotencyKeyRow).where(
            IdempotencyKeyRow.tenant_id == record.tenant_id,
            IdempotencyKeyRow.key == record.key,
            IdempotencyKeyRow.request_hash == record.request_hash,
        )
    )


def sweep(session: Session, now: float) -> int:
    """Delete every tenant's expired keys (for the reaper); returns how many."""
    result = session.execute(delete(IdempotencyKeyRow).where(IdempotencyKeyRow.expires_at <= now))
    return int(getattr(result, "rowcount", 0) or 0)
