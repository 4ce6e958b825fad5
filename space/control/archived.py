"""What the artifact store holds, as placement needs it (issue 19;
space.control.archives does the store's work): which nodes reach the store, on which
nodes a snapshot can be used, and copying a snapshot to a node from the store.

A snapshot is used on its own node, or, if the store holds it, on any node that has the
store: that node gets a copy from the store first (``fetch_snapshot``), and keeps it
for later creates; reconciliation leaves such a copy alone while the snapshot is listed
(``keeps_copy``) and deletes it once the snapshot is deleted.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy.orm import Session

from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.scheduler import rank_nodes
from space.control.store import nodes as node_rows
from space.control.store import repo
from space.control.store import snapshots as snaps
from space.control.store.nodes import NodeRecord
from space.control.store.snapshots import SnapshotRecord

__all__ = ["archiving_nodes", "fetch_snapshot", "keeps_copy", "snapshot_nodes"]


def archiving_nodes(records: Iterable[NodeRecord], reachable: Iterable[str]) -> list[str]:
    """The ids of the nodes among ``reachable`` that are not lost and have a store."""
    callable_here = set(reachable)
    return [
        node.id
        for node in records
        if node.id in callable_here
        and node.state != node_rows.LOST
        and (node.capacity or {}).get("archives", False)
    ]


async def snapshot_nodes(ctx: ControlContext, snapshot: SnapshotRecord) -> list[str]:
    """The nodes a sandbox from ``snapshot`` may be made on, in the order to ask them:
    its own node if active; then, if the store holds it, every other active node with
    the store in placement order; then its own node if draining. Never a lost node:
    ApiError(unavailable) if that leaves none."""

    def read(session: Session) -> tuple[list[NodeRecord], dict[str, int]]:
        return node_rows.list_nodes(session), repo.active_counts(session)

    records, load = await ctx.db.run(read)
    reachable = ctx.nodes.ids()
    ranked = rank_nodes(records, load, reachable=reachable)  # active nodes only
    home = snapshot.node_id
    nodes = [home] if home in ranked else []
    if snapshot.archived:
        with_store = set(archiving_nodes(records, reachable))
        nodes += [n for n in ranked if n in with_store and n != home]
    if home in reachable and home not in nodes:
        nodes.append(home)  # draining: still used, last
    if not nodes:
        raise ApiError(
            "unavailable",
            f"snapshot {snapshot.id}'s node {snapshot.node_id} is lost, and the artifact store"
            " does not hold it (yet)",
            snapshot_id=snapshot.id,
        )
    return nodes


async def fetch_snapshot(ctx: ControlContext, snapshot: SnapshotRecord, node_id: str) -> None:
    """Make sure node ``node_id`` holds ``snapshot``: its own node does; another gets a
    copy from the store. Raises ApiError(conflict) if the store does not hold it, or
    the node's NodeError."""
    if node_id == snapshot.node_id:
        return
    if not snapshot.archived:
        raise ApiError(
            "conflict",
            f"snapshot {snapshot.id} is on node {snapshot.node_id} only, not in the artifact"
            f" store: it cannot be used on node {node_id}",
            snapshot_id=snapshot.id,
        )
    await ctx.nodes.get(node_id).fetch_snapshot(snapshot.id)


def keeps_copy(record: SnapshotRecord | None) -> bool:
    """Whether a node other than the snapshot's own may keep a copy of it: while it is
    listed and the store holds it (then it was fetched from there)."""
    return record is not None and record.state == snaps.READY and record.archived
