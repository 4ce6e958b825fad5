"""API keys: made once, shown once, stored as SHA-256 only.

A key is ``sk_space_`` + 32 random bytes (urlsafe base64). Because the secret is
high-entropy, looking a key up by its hash is safe (no per-key salt needed); the found
hash is still compared in constant time. ``create_key``, ``list_keys`` and
``revoke_key`` are blocking helpers for the CLI; they apply migrations first.

A replica trusts a key it found valid for ``VERDICT_TTL_S`` without asking the
database again (``KeyVerdicts``, issue 21: the lookup was a database round trip on every
request). A revoke is a write to the database, which every replica shares and none is
told of: each refuses the key at the latest ``VERDICT_TTL_S`` after the revoke
committed, when its verdict runs out. Unknown and revoked keys are never remembered:
a new key works at once, and a wrong one costs its lookup every time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from space.control.errors import ApiError
from space.control.settings import ControlSettings
from space.control.store.db import migrated
from space.control.store.dialects import upsert
from space.control.store.models import ApiKeyRow, TenantRow

__all__ = [
    "KEY_PREFIX",
    "VERDICT_TTL_S",
    "KeyInfo",
    "KeyVerdicts",
    "add_key",
    "create_key",
    "hash_key",
    "list_keys",
    "revoke_key",
    "tenant_for_key",
]

KEY_PREFIX = "sk_space_"
_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_DISPLAY_CHARS = len(KEY_PREFIX) + 6
#: How long a replica trusts a key it found valid (seconds): the longest a revoked key
#: still works.
VERDICT_TTL_S = 5.0
#: The most verdicts a replica keeps (past it, expired ones are dropped, then all).
_MAX_VERDICTS = 10_000


@dataclass(frozen=True, slots=True)
class KeyInfo:
    id: str
    tenant: str
    prefix: str
    created_at: float
    revoked_at: float | None


def hash_key(key: str) -> str:
    """Hex SHA-256 of a key, as stored."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def add_key(session: Session, tenant: str, now: float) -> str:
    """Create ``tenant`` if needed and a key for it; returns the plaintext key.

    Raises ApiError(invalid_argument) for a malformed tenant name.
    """
    if not _TENANT_RE.fullmatch(tenant):
        raise ApiError("invalid_argument", f"invalid tenant name {tenant!r}", tenant=tenant)
    # Atomic: two first keys of one tenant (or two replicas) make one tenant.
    upsert(session, TenantRow, {"id": tenant, "created_at": now}, keys=["id"])
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    session.add(
        ApiKeyRow(
            id="key_" + secrets.token_hex(8),
            tenant_id=tenant,
            prefix=key[:_DISPLAY_CHARS],
            key_hash=hash_key(key),
            created_at=now,
        )
    )
    return key


def tenant_for_key(session: Session, key: str) -> str | None:
    """The tenant of a valid, unrevoked key, or None."""
    digest = hash_key(key)
    row = session.scalars(
        select(ApiKeyRow).where(ApiKeyRow.key_hash == digest, ApiKeyRow.revoked_at.is_(None))
    ).one_or_none()
    if row is None or not hmac.compare_digest(row.key_hash, digest):
        return None
    return row.tenant_id


class KeyVerdicts:
    """The tenants of keys this replica found valid less than VERDICT_TTL_S ago, by
    the key's hash (the key itself is not kept). For one event loop: not thread-safe."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._valid: dict[str, tuple[str, float]] = {}

    def tenant(self, key: str) -> str | None:
        """The tenant of ``key`` if it was found valid less than VERDICT_TTL_S ago."""
        found = self._valid.get(hash_key(key))
        if found is None or not 0 <= self._clock() - found[1] < VERDICT_TTL_S:
            return None
        return found[0]

    def remember(self, key: str, tenant: str) -> None:
        """Record ``key`` as found valid for ``tenant`` now."""
        now = self._clock()
        if len(self._valid) >= _MAX_VERDICTS:
            fresh = {k: v for k, v in self._valid.items() if now - v[1] < VERDICT_TTL_S}
            self._valid = fresh if len(fresh) < _MAX_VERDICTS else {}
        self._valid[hash_key(key)] = (tenant, now)


def create_key(settings: ControlSettings, tenant: str) -> str:
    """Make a key for ``tenant`` (created if new); the plaintext is returned only here."""
    with migrated(settings.database_url) as db:
        return db.call(lambda s: add_key(s, tenant, time.time()))


def list_keys(settings: ControlSettings, tenant: str | None = None) -> list[KeyInfo]:
    """Every key (or ``tenant``'s), revoked ones included, oldest first."""

    def query(session: Session) -> list[KeyInfo]:
        stmt = select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.id)
        if tenant is not None:
            stmt = stmt.where(ApiKeyRow.tenant_id == tenant)
        return [
            KeyInfo(r.id, r.tenant_id, r.prefix, r.created_at, r.revoked_at)
            for r in session.scalars(stmt)
        ]

    with migrated(settings.database_url) as db:
        return db.call(query)


def revoke_key(settings: ControlSettings, key_id: str) -> None:
    """Revoke a key by id (idempotent). Raises ApiError(not_found) for an unknown id."""

    def revoke(session: Session) -> None:
        row = session.get(ApiKeyRow, key_id)
        if row is None:
            raise ApiError("not_found", f"no API key {key_id!r}", key_id=key_id)
        session.execute(
            update(ApiKeyRow)
            .where(ApiKeyRow.id == key_id, ApiKeyRow.revoked_at.is_(None))
            .values(revoked_at=time.time())
        )

    with migrated(settings.database_url) as db:
        db.call(revoke)
