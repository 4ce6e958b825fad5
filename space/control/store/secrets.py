"""Queries on secrets. Every tenant-facing lookup filters by tenant in SQL.

A row holds the secret's metadata and its value sealed (``Sealed``; how it is sealed
is space.control.secrets'); nothing here ever sees a plaintext value. Functions take
an open Session and return frozen records.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from space.control.store.dialects import upsert
from space.control.store.models import SecretRow

__all__ = [
    "Sealed",
    "SecretRecord",
    "delete_secret",
    "find_secret",
    "find_secrets",
    "list_secrets",
    "replace_sealed",
    "sealed_by_other_keys",
    "upsert_secret",
]


@dataclass(frozen=True, slots=True)
class Sealed:
    """A value as stored: ``ciphertext`` under a data key with ``nonce``; ``wrapped_key``
    that data key under master key ``key_id`` (its own nonce first)."""

    key_id: str
    wrapped_key: bytes
    nonce: bytes
    ciphertext: bytes


@dataclass(frozen=True, slots=True)
class SecretRecord:
    tenant_id: str
    name: str
    hosts: tuple[str, ...]
    #: The environment variable holding the placeholder in its sandboxes.
    env: str
    injection: str
    header: str | None
    format: str
    sealed: Sealed
    created_at: float
    updated_at: float


def _record(row: SecretRow) -> SecretRecord:
    return SecretRecord(
        tenant_id=row.tenant_id,
        name=row.name,
        hosts=tuple(row.hosts),
        env=row.env,
        injection=row.injection,
        header=row.header,
        format=row.format,
        sealed=Sealed(row.key_id, row.wrapped_key, row.nonce, row.ciphertext),
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def upsert_secret(session: Session, record: SecretRecord) -> SecretRecord:
    """Create or replace the tenant's secret ``record.name``; a replaced one keeps its
    ``created_at``. Atomic (two writers of one name: the last wins). Returns the record
    as stored."""
    values = {
        "tenant_id": record.tenant_id,
        "name": record.name,
        "hosts": list(record.hosts),
        "env": record.env,
        "injection": record.injection,
        "header": record.header,
        "format": record.format,
        "key_id": record.sealed.key_id,
        "wrapped_key": record.sealed.wrapped_key,
        "nonce": record.sealed.nonce,
        "ciphertext": record.sealed.ciphertext,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
    }
    keys = ["tenant_id", "name"]
    upsert(session, SecretRow, values, keys, [c for c in values if c not in (*keys, "created_at")])
    query = (
        select(SecretRow)
        .where(SecretRow.tenant_id == record.tenant_id, SecretRow.name == record.name)
        .execution_options(populate_existing=True)
    )
    return _record(session.scalars(query).one())


def find_secret(session: Session, tenant_id: str, name: str) -> SecretRecord | None:
    """The tenant's secret ``name``, or None (another tenant's is exactly a missing one)."""
    query = select(SecretRow).where(SecretRow.tenant_id == tenant_id, SecretRow.name == name)
    row = session.scalars(query).one_or_none()
    return _record(row) if row else None


def find_secrets(
    session: Session, tenant_id: str, names: Collection[str]
) -> dict[str, SecretRecord]:
    """The tenant's secrets among ``names``, by name (missing ones left out)."""
    if not names:
        return {}
    query = select(SecretRow).where(SecretRow.tenant_id == tenant_id, SecretRow.name.in_(names))
    return {row.name: _record(row) for row in session.scalars(query)}


def list_secrets(session: Session, tenant_id: str) -> list[SecretRecord]:
    """The tenant's secrets by name, in code point order: sorted here, as a database's
    collation may order ``A_b`` and ``Ab`` either way (PostgreSQL's follows the locale)."""
    query = select(SecretRow).where(SecretRow.tenant_id == tenant_id)
    return sorted((_record(row) for row in session.scalars(query)), key=lambda r: r.name)


def delete_secret(session: Session, tenant_id: str, name: str) -> bool:
    """Delete the tenant's secret; False if it did not exist (idempotent)."""
    result = session.execute(
        delete(SecretRow).where(SecretRow.tenant_id == tenant_id, SecretRow.name == name)
    )
    return bool(getattr(result, "rowcount", 0))


def sealed_by_other_keys(session: Session, key_id: str) -> list[SecretRecord]:
    """Every tenant's secrets whose data key is wrapped by a master key other than
    ``key_id`` (for rotation, not for tenants)."""
    query = select(SecretRow).where(SecretRow.key_id != key_id)
    return [_record(row) for row in session.scalars(query)]


def replace_sealed(session: Session, old: SecretRecord, sealed: Sealed) -> bool:
    """Store ``sealed`` for ``old``'s row only if the row still holds ``old.sealed``.

    Returns False (nothing written) if the secret was replaced or deleted meanwhile:
    rotation must never pair a re-wrapped old data key with a new ciphertext.
    """
    result = session.execute(
        update(SecretRow)
        .where(
            SecretRow.tenant_id == old.tenant_id,
            SecretRow.name == old.name,
            SecretRow.key_id == old.sealed.key_id,
            SecretRow.wrapped_key == old.sealed.wrapped_key,
            SecretRow.ciphertext == old.sealed.ciphertext,
        )
        .values(key_id=sealed.key_id, wrapped_key=sealed.wrapped_key, nonce=sealed.nonce)
    )
    return bool(getattr(result, "rowcount", 0))
