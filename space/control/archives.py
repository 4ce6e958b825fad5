"""The control plane's side of the artifact store (issue 19): which snapshots and
hibernated sandboxes are kept there, where they are restored, and which bundles go.

Nodes that report ``archives`` (they have a store: ``space node --artifact-store``) are
asked, by a background job (space.control.background) that runs in one replica:
- to upload each hibernated sandbox no bundle holds yet (``archive_sandbox``: its
  answer names the bundle, which the row keeps while the sandbox stays as it was), and
  each published snapshot not yet stored (``archive_snapshot``);
- to wake elsewhere the lost sandboxes a bundle holds: the best other node imports it
  (``import_archive``), the row moves there (only if it is still as read: lost, on the
  lost node, naming that bundle), hibernated, and its egress policy and secret grants
  follow; if the old node comes back, reconciliation deletes its copy (no row claims it);
- to delete the stale bundles (space.control.store.archives says how they go stale).

Where a snapshot is used from the store: space.control.archived.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace

from sqlalchemy.orm import Session

from space.control import broker
from space.control.archived import archiving_nodes
from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.scheduler import rank_nodes
from space.control.store import archives as rows
from space.control.store import nodes as node_rows
from space.control.store import repo
from space.control.store.nodes import NodeRecord
from space.node.api import NodeError, NodeService

__all__ = ["archive_round", "rehome_round"]

log = logging.getLogger(__name__)

#: Stale bundles deleted per round (a round must end well inside its job lease).
_STALE_PER_ROUND = 64


async def archive_round(ctx: ControlContext, *, budget_s: float) -> None:
    """Upload what is not stored yet and delete what is stale (the module docstring),
    starting no upload after ``budget_s`` (the rest is next round's: a round must end
    inside its job lease). A node that fails is logged and asked again next round."""
    deadline = time.monotonic() + budget_s
    records = await ctx.db.read(node_rows.list_nodes)
    nodes = archiving_nodes(records, ctx.nodes.ids())
    for node_id in nodes:
        node = ctx.nodes.get(node_id)
        try:
            await _archive_node(ctx, node_id, node, deadline)
        except (NodeError, ApiError) as exc:
            log.warning("could not archive on node %s: %s", node_id, exc)
    if nodes:
        await _delete_stale(ctx, ctx.nodes.get(nodes[0]))


async def _archive_node(
    ctx: ControlContext, node_id: str, node: NodeService, deadline: float
) -> None:
    sandboxes = await ctx.db.run(functools.partial(rows.hibernated_unarchived, node_id=node_id))
    for record in sandboxes:
        if time.monotonic() > deadline:
            return
        try:
            status = await node.archive_sandbox(record.id)
        except NodeError as exc:  # woken meanwhile, or deleted: the next round sees
            log.info("sandbox %s not archived: %s", record.id, exc)
            continue
        if status.archive is not None:
            # Only the name: the row's state is the requests' (a wake may have won).
            name = functools.partial(rows.name_archive, record=record, archive=status.archive)
            await ctx.db.run(name)
    snapshot_ids = await ctx.db.run(functools.partial(rows.unarchived_snapshots, node_id=node_id))
    for snapshot_id in snapshot_ids:
        if time.monotonic() > deadline:
            return
        await node.archive_snapshot(snapshot_id)
        await ctx.db.run(functools.partial(rows.mark_snapshot_archived, snapshot_id=snapshot_id))


async def _delete_stale(ctx: ControlContext, node: NodeService) -> None:
    for name in await ctx.db.run(functools.partial(rows.stale, limit=_STALE_PER_ROUND)):
        try:
            await node.delete_archive(name)
        except NodeError as exc:
            log.warning("could not delete stale archive %s: %s", name, exc)
            return
        await ctx.db.run(functools.partial(rows.forget_stale, name=name))


async def rehome_round(ctx: ControlContext) -> list[str]:
    """Wake every lost sandbox a bundle holds on another node, hibernated there (the
    module docstring); returns the ids moved. One no node takes is tried next round."""

    def read(session: Session) -> tuple[list[repo.SandboxRecord], list[NodeRecord], dict[str, int]]:
        lost = rows.lost_archived(session)
        return lost, node_rows.list_nodes(session), repo.active_counts(session)

    lost, records, load = await ctx.db.read(read)
    if not lost:
        return []
    with_store = set(archiving_nodes(records, ctx.nodes.ids()))
    moved = []
    for record in lost:
        ranked = rank_nodes(records, load, reachable=ctx.nodes.ids(), guest=record.guest)
        for target in (n for n in ranked if n in with_store and n != record.node_id):
            if await _rehome(ctx, record, target):
                moved.append(record.id)
                load[target] = load.get(target, 0) + 1
                break
    return moved


async def _rehome(ctx: ControlContext, record: repo.SandboxRecord, target: str) -> bool:
    assert record.archive is not None
    node = ctx.nodes.get(target)
    try:
        result = await node.import_archive(record.id, record.archive)
    except NodeError as exc:
        log.warning("lost sandbox %s not restored on %s: %s", record.id, target, exc)
        return False
    if not await ctx.db.run(lambda s: rows.rehome_lost(s, record, target)):
        # The row changed meanwhile (its node came back, or it was deleted): the copy
        # made here is nobody's.
        log.info("lost sandbox %s changed while it was restored on %s", record.id, target)
        try:
            await node.delete_sandbox(record.id)
        except NodeError as exc:  # reconciliation deletes it: no row claims it
            log.warning("could not delete the unclaimed copy of %s: %s", record.id, exc)
        return False
    log.warning("lost sandbox %s restored on %s from %s", record.id, target, record.archive)
    # The row says so already (rehome_lost): nothing else to write.
    moved = replace(record, node_id=target, state=result.status.state.value)
    try:
        await node.set_egress(record.id, record.egress)
        if record.secrets:
            await broker.push(ctx, moved)
    except (NodeError, ApiError) as exc:
        log.warning("restored sandbox %s: its egress or grants not set yet: %s", record.id, exc)
    return True
