"""Moves of suspended sandboxes between nodes, and the drain that makes them (issue 19).

A move asks the sandbox's node (the source) to offer it (``export_sandbox``: it must
be hibernated, so a paused one is hibernated first), the target to pull it from the
source's URL with the offer's ticket (``import_sandbox``: checksummed; a failure
leaves nothing there), then moves the row to the target, and tells the source the move
is over (``finish_export``: it deletes its copy, or, if the move failed, lets the
sandbox go on there). Whatever fails, one node has the sandbox and the row says which:
a crash after the import leaves a copy no row claims on one side, which reconciliation
deletes. Secret grants are sent to the target (a node holds them in memory only).

A ``draining`` node's paused and hibernated sandboxes are moved away by a background
job (space.control.background), a sandbox at a time, to the node placement ranks
first among the others (nodes that reported no room last). A target admits what it
imports as it would a create of its size, before any byte moves (space.node.agent.
_moves): one without room refuses with InsufficientCapacity, the sandbox stays whole
on its node, and the next target is asked; a sandbox no node takes is tried again next
round. Running sandboxes stay: draining places nothing new, and their owners decide.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

from sqlalchemy.orm import Session

from space.control import broker
from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.lifecycle import check_state, hibernate_sandbox, record_status
from space.control.nodes import LOCAL_URL
from space.control.scheduler import rank_nodes
from space.control.store import nodes as node_rows
from space.control.store import repo
from space.control.store.repo import SandboxRecord
from space.control.template_names import node_name, parse_ref
from space.node.api import NodeError, SandboxState

__all__ = ["MOVABLE", "drain_round", "move_sandbox"]

log = logging.getLogger(__name__)

#: What a drain moves: suspended sandboxes (a paused one is hibernated first).
MOVABLE = frozenset({SandboxState.PAUSED.value, SandboxState.HIBERNATED.value})


async def move_sandbox(ctx: ControlContext, record: SandboxRecord, target: str) -> SandboxRecord:
    """Move ``record`` (paused or hibernated) to node ``target``; returns it there,
    hibernated. Raises ApiError(conflict) for another state, ApiError(invalid_argument)
    for a move to its own node or between nodes that do not reach each other (an
    embedded node), or the NodeError of the node that failed (the sandbox is then where
    it was)."""
    check_state("move", record, MOVABLE)
    if target == record.node_id:
        raise ApiError("invalid_argument", f"sandbox {record.id} is on {target} already")
    source_url = ctx.nodes.url(record.node_id)
    if LOCAL_URL in (source_url, ctx.nodes.url(target)):
        raise ApiError(
            "invalid_argument", "an embedded node's sandboxes do not move", sandbox_id=record.id
        )
    if record.state == SandboxState.PAUSED.value:
        record = await hibernate_sandbox(ctx, record)
    source = ctx.nodes.get(record.node_id)
    offer = await source.export_sandbox(record.id)
    moved = False
    try:
        result = await ctx.nodes.get(target).import_sandbox(offer, source_url)
        await ctx.db.run(lambda s: repo.set_node(s, record.id, target))
        moved = True
    finally:
        try:
            await source.finish_export(record.id, offer.ticket, moved=moved)
        except NodeError as exc:  # reconciliation deletes the source's copy
            log.warning("move of %s: the source did not finish: %s", record.id, exc)
    log.info(
        "moved %s from %s to %s (%d bytes, %s)", record.id, record.node_id, target,
        result.stream_bytes, "full" if result.parent is None else "incremental",
    )  # fmt: skip
    record = await record_status(ctx, replace(record, node_id=target), result.status)
    if record.secrets:
        await broker.push(ctx, record)
    return record


async def drain_round(ctx: ControlContext) -> list[str]:
    """Move every movable sandbox off every draining node it can; returns the ids
    moved. One that no node takes is logged and left for the next round."""
    records, load = await ctx.db.read(_draining)
    moved = []
    for node in (n for n in records if n.state == node_rows.DRAINING):
        for record in await ctx.db.run(functools.partial(repo.on_node, node_id=node.id)):
            if record.state not in MOVABLE:
                continue
            template = node_name(record.tenant_id, parse_ref(record.template).name)
            ranked = rank_nodes(
                records, load, reachable=ctx.nodes.ids(), template=template, guest=record.guest
            )
            targets = [t for t in ranked if t != node.id and ctx.nodes.url(t) != LOCAL_URL]
            target = await _move_to_first(ctx, record, targets)
            if target is not None:
                moved.append(record.id)
                load[target] = load.get(target, 0) + 1
    return moved


async def _move_to_first(
    ctx: ControlContext, record: SandboxRecord, targets: list[str]
) -> str | None:
    """Move ``record`` to the first of ``targets`` that takes it (a target without room
    refuses the import: InsufficientCapacity); the one that did, or None. After a
    refusal the row is read again: a paused sandbox is hibernated by then, and one
    woken, deleted or moved meanwhile is left alone."""
    source = record.node_id
    for target in targets:
        try:
            await move_sandbox(ctx, record, target)
        except (NodeError, ApiError) as exc:
            log.warning("drain of %s: %s not moved to %s: %s", source, record.id, target, exc)
            now = await ctx.db.run(
                functools.partial(
                    repo.find_sandbox, tenant_id=record.tenant_id, sandbox_id=record.id
                )
            )
            if now is None or now.node_id != source or now.state not in MOVABLE:
                return None
            record = now
            continue
        return target
    return None


def _draining(session: Session) -> tuple[list[node_rows.NodeRecord], dict[str, int]]:
    return node_rows.list_nodes(session), repo.active_counts(session)
