"""The operator's quota commands (``space quota set/show``), on the database directly.

Blocking helpers for the CLI, as space.control.keys' are; they apply migrations first.
What they show is the database's: the limits in effect (``ControlSettings.quotas``
with the tenant's overrides) and the use the database counts. Templates and builds
live on the nodes and in the running server: ``GET /v1/quota`` has them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy.orm import Session

from space.control.errors import ApiError
from space.control.quota_checks import limits
from space.control.quotas import QUOTA_NAMES, QUOTAS, Quota
from space.control.settings import ControlSettings
from space.control.store import quotas as store
from space.control.store.db import migrated

__all__ = ["QuotaLine", "set_quotas", "show_quotas"]


@dataclass(frozen=True, slots=True)
class QuotaLine:
    """One quota of a tenant: its limit, whether that is the tenant's own (else the
    default), and its use (None where the database does not know it)."""

    quota: Quota
    limit: int
    own: bool
    used: int | None


def _known(session: Session, tenant: str) -> None:
    if not store.tenant_exists(session, tenant):
        raise ApiError("not_found", f"no tenant {tenant!r}", tenant=tenant)


def set_quotas(
    settings: ControlSettings,
    tenant: str,
    changes: Mapping[str, int | None],
    *,
    reset: bool = False,
) -> list[QuotaLine]:
    """Give ``tenant`` its own limits: quota name → limit, or None for the default
    again; with ``reset``, every quota not in ``changes`` goes back to the default
    too. All or nothing, in one transaction; returns the tenant's quotas after.

    Raises ApiError: not_found for an unknown tenant, invalid_argument for an unknown
    quota or a negative limit. Idempotent.
    """
    unknown = sorted(set(changes) - QUOTA_NAMES)
    if unknown:
        raise ApiError("invalid_argument", f"no quota {unknown[0]!r}", quota=unknown[0])
    for name, value in changes.items():
        if value is not None and value < 0:
            raise ApiError("invalid_argument", f"quota {name} must be >= 0, got {value}")
    now = time.time()

    def change(session: Session) -> None:
        _known(session, tenant)
        back = QUOTA_NAMES if reset else frozenset()
        store.reset_limits(session, tenant, back | {k for k, v in changes.items() if v is None})
        for name, value in changes.items():
            if value is not None:
                store.set_limit(session, tenant, name, value, now)

    with migrated(settings.database_url) as db:
        db.call(change)
        return db.call(lambda s: _lines(s, settings, tenant))


def show_quotas(settings: ControlSettings, tenant: str) -> list[QuotaLine]:
    """``tenant``'s quotas in QUOTAS order. Raises ApiError(not_found) for an unknown
    tenant."""
    with migrated(settings.database_url) as db:
        return db.call(lambda s: _lines(s, settings, tenant))


def _lines(session: Session, settings: ControlSettings, tenant: str) -> list[QuotaLine]:
    _known(session, tenant)
    own = store.overrides(session, tenant)
    mine = limits(session, settings.quotas, tenant)
    used: Mapping[str, int] = store.usage(session, tenant)
    return [QuotaLine(q, mine.of(q), q.name in own, used.get(q.name)) for q in QUOTAS]
