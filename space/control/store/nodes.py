"""Queries on nodes: registration, heartbeats and leases, drain and loss (issue 19).

A node holds a lease that each heartbeat renews; one whose lease ran out is ``lost``
and so is every sandbox it had that was not deleted or failed: said plainly (state
``lost``, the reason in ``error``), never removed. A lost node that heartbeats again
is ``active`` again, and reconciliation gives its sandboxes back the state the node
reports. A ``draining`` node gets no new sandboxes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from space.control.store.dialects import upsert
from space.control.store.models import NodeRow, SandboxRow
from space.node.api import SandboxState

__all__ = [
    "ACTIVE",
    "DRAINING",
    "LOST",
    "NodeRecord",
    "expire_leases",
    "heartbeat",
    "list_nodes",
    "node_boot_id",
    "set_node_boot_id",
    "set_node_state",
    "url_of",
]

ACTIVE = "active"
DRAINING = "draining"
LOST = "lost"
#: What a lost node takes with it: every sandbox it had that was still a sandbox.
_HELD_STATES = tuple(
    state.value
    for state in (
        SandboxState.CREATING,
        SandboxState.RUNNING,
        SandboxState.PAUSED,
        SandboxState.HIBERNATED,
        SandboxState.STOPPED,
    )
)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    id: str
    url: str
    state: str
    #: None: it never heartbeat (an embedded node before its first round, or an older
    #: node agent), so it cannot be lost either.
    lease_expires_at: float | None
    last_seen: float | None
    #: As reported (space.control.schemas.NodeCapacity), or None.
    capacity: dict[str, Any] | None


def _record(row: NodeRow) -> NodeRecord:
    return NodeRecord(row.id, row.url, row.state, row.lease_expires_at, row.last_seen, row.capacity)


def heartbeat(
    session: Session,
    node_id: str,
    url: str,
    now: float,
    *,
    lease_s: float | None = None,
    capacity: dict[str, Any] | None = None,
) -> bool:
    """Record a node (or its new URL) as seen at ``now``; with ``lease_s``, renew its
    lease until ``now + lease_s`` and keep ``capacity``. Atomic, so two replicas may.
    True if the node was lost until now (it is active again)."""
    values: dict[str, Any] = {"id": node_id, "url": url, "last_seen": now}
    if lease_s is not None:
        values |= {"lease_expires_at": now + lease_s, "capacity": capacity}
    upsert(session, NodeRow, values, keys=["id"], update=[k for k in values if k != "id"])
    back = session.execute(
        update(NodeRow).where(NodeRow.id == node_id, NodeRow.state == LOST).values(state=ACTIVE)
    )
    return bool(getattr(back, "rowcount", 0))


def list_nodes(session: Session) -> list[NodeRecord]:
    """Every node ever registered, lost ones included, by id."""
    return [_record(row) for row in session.scalars(select(NodeRow).order_by(NodeRow.id))]


def url_of(session: Session, node_id: str) -> str | None:
    """The URL recorded for ``node_id``, or None if there is no such node."""
    row = session.get(NodeRow, node_id)
    return None if row is None else row.url


def set_node_state(session: Session, node_id: str, state: str) -> NodeRecord | None:
    """Set a node ``active`` or ``draining`` (a lost node stays lost until it heartbeats);
    the node as it is now, or None if there is no such node."""
    session.execute(
        update(NodeRow).where(NodeRow.id == node_id, NodeRow.state != LOST).values(state=state)
    )
    row = session.get(NodeRow, node_id)
    return None if row is None else _record(row)


def expire_leases(session: Session, now: float) -> dict[str, list[str]]:
    """Mark lost every node whose lease ran out before ``now``, and its sandboxes;
    returns the nodes newly lost, each with the ids of the sandboxes it took."""
    expired = session.scalars(
        select(NodeRow)
        .where(NodeRow.state != LOST, NodeRow.lease_expires_at < now)
        .with_for_update()
    ).all()
    lost: dict[str, list[str]] = {}
    for row in expired:
        row.state = LOST
        reason = f"node {row.id} lost: no heartbeat since {row.last_seen or 0:.0f} (epoch s)"
        taken = session.scalars(
            update(SandboxRow)
            .where(SandboxRow.node_id == row.id, SandboxRow.state.in_(_HELD_STATES))
            .values(state=SandboxState.LOST.value, error=reason)
            .returning(SandboxRow.id)
        ).all()
        lost[row.id] = list(taken)
    return lost


def node_boot_id(session: Session, node_id: str) -> str | None:
    """The boot id the node had when its sandboxes' grants were last all sent; None if
    never (or forgotten, so that they are sent again)."""
    row = session.get(NodeRow, node_id)
    return None if row is None else row.boot_id


def set_node_boot_id(session: Session, node_id: str, boot_id: str | None) -> None:
    session.execute(update(NodeRow).where(NodeRow.id == node_id).values(boot_id=boot_id))
