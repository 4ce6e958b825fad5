"""Counts for the platform's Prometheus gauges (space.control.prometheus): one grouped
query each, read at every scrape from the database all replicas share."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from space.control.store.models import NodeRow, SandboxRow
from space.control.store.repo import DELETED

__all__ = ["nodes_by_state", "sandboxes_by_state"]


def sandboxes_by_state(session: Session) -> dict[str, int]:
    """How many sandboxes are in each state; deleted rows (kept a while) are no sandbox."""
    query = select(SandboxRow.state, func.count()).where(SandboxRow.state != DELETED)
    rows = session.execute(query.group_by(SandboxRow.state))
    return {state: count for state, count in rows}


def nodes_by_state(session: Session) -> dict[str, int]:
    """How many registered nodes are in each state (active, draining, lost)."""
    rows = session.execute(select(NodeRow.state, func.count()).group_by(NodeRow.state))
    return {state: count for state, count in rows}
