"""Job leases: which control-plane replica runs a background job (issue 19).

Every replica runs the same background loop; a job (the reaper, node lease expiry,
reconciliation) runs in a round only in the replica that holds its lease. Taking or
renewing a lease is one conditional UPDATE (after an INSERT … ON CONFLICT DO NOTHING
that makes the row once), atomic on SQLite and PostgreSQL alike: of two replicas
asking at once, one gets it. A replica that dies stops renewing, and another takes
the job over once the lease has run out.
"""

from __future__ import annotations

from sqlalchemy import delete, or_, update
from sqlalchemy.orm import Session

from space.control.store.dialects import upsert
from space.control.store.models import JobLeaseRow

__all__ = ["clear", "release", "take"]


def take(session: Session, name: str, holder: str, now: float, ttl_s: float) -> bool:
    """Hold the lease ``name`` until ``now + ttl_s`` if it is free, run out or already
    ``holder``'s; True if ``holder`` holds it now."""
    values = {"name": name, "holder": holder, "expires_at": now + ttl_s}
    upsert(session, JobLeaseRow, values, keys=["name"])
    taken = session.execute(
        update(JobLeaseRow)
        .where(JobLeaseRow.name == name)
        .where(or_(JobLeaseRow.holder == holder, JobLeaseRow.expires_at < now))
        .values(holder=holder, expires_at=now + ttl_s)
    )
    return bool(getattr(taken, "rowcount", 0))


def release(session: Session, holder: str) -> None:
    """Give up every lease ``holder`` holds (a replica shutting down), so another takes
    its jobs at once instead of after the leases run out."""
    session.execute(delete(JobLeaseRow).where(JobLeaseRow.holder == holder))


def clear(session: Session) -> None:
    """Drop every lease: for a replica that knows it is the only one (on SQLite), whose
    predecessor's leases a crash left behind."""
    session.execute(delete(JobLeaseRow))
