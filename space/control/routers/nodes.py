"""``/v1/nodes``: node agents register and heartbeat here; operators read their state,
load and capacity, and drain them. All with the node token."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from space.control import background
from space.control.deps import Context, ControlContext, require_node_token
from space.control.errors import ApiError
from space.control.reconcile import reconcile_node
from space.control.routers.pools import NODE_INFO_TIMEOUT_S
from space.control.schemas import NodeCapacity, NodeRegistration
from space.control.store import nodes as node_rows
from space.node.api import CapacityInfo, NodeError

__all__ = ["NodeOut", "Registered", "router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


class NodeOut(BaseModel):
    """A registered node as an operator sees it (``GET /v1/nodes``)."""

    node_id: str
    #: Where the control plane reaches it (``local``: a node embedded in a replica).
    url: str
    #: ``active``, ``draining`` (placed on no more) or ``lost`` (its lease ran out).
    state: str
    #: When its lease runs out unless it heartbeats (null: it holds none) and when it
    #: was last heard from, seconds since the epoch.
    lease_expires_at: float | None
    last_seen: float | None
    #: What it reported with its last heartbeat.
    reported: NodeCapacity | None
    #: False if it did not answer within NODE_INFO_TIMEOUT_S (a lost node is not
    #: asked); what follows is then null.
    reachable: bool
    #: Its sandboxes, in any state.
    sandboxes: int | None = None
    #: What its admission decides from (space/node/core/capacity.py), ``room`` included:
    #: how many more default sandboxes it would admit now.
    capacity: CapacityInfo | None = None


class Registered(BaseModel):
    node_id: str
    url: str
    #: How often the node is to heartbeat, and how long each heartbeat's lease lasts.
    heartbeat_s: float
    lease_s: float


@router.post("", dependencies=[Depends(require_node_token)])
async def register_node(body: NodeRegistration, ctx: Context) -> Registered:
    """Record the node and place sandboxes on it; each call is also its heartbeat,
    renewing its lease (when it reports its capacity) for ``node_lease_s``.
    Idempotent per id and URL.

    A node new to this replica, or back from lost, is reconciled (one that cannot be
    reconciled right away is still registered: reconciliation runs again later).
    Raises 409 for the id of a node embedded in this replica.
    """
    new = ctx.nodes.url_of(body.node_id) != body.url
    await ctx.nodes.register_remote(body.node_id, body.url, ctx.node_token)
    lease = body.capacity is not None
    await background.record_heartbeat(ctx, body.node_id, body.url, body.capacity, lease=lease)
    if new:
        with contextlib.suppress(NodeError, ApiError):
            await reconcile_node(ctx, body.node_id)
    settings = ctx.settings
    return Registered(
        node_id=body.node_id,
        url=body.url,
        heartbeat_s=settings.node_heartbeat_s,
        lease_s=settings.node_lease_s,
    )


@router.get("", dependencies=[Depends(require_node_token)])
async def list_nodes(ctx: Context) -> dict[str, list[NodeOut]]:
    """Every node the database knows, lost ones included, by id, with its sandboxes and
    capacity figures; live nodes are asked concurrently, and one that fails to answer
    in time is listed unreachable (and logged), never an error of the listing.
    Read-only."""
    records = await ctx.db.run(node_rows.list_nodes)
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(_node(ctx, record)) for record in records]
    return {"nodes": [task.result() for task in tasks]}


@router.post("/{node_id}/drain", dependencies=[Depends(require_node_token)])
async def drain_node(node_id: str, ctx: Context) -> NodeOut:
    """Place no more sandboxes on the node (``draining``); idempotent. Raises 404 for an
    unknown node, 409 for a lost one."""
    return await _set_state(ctx, node_id, node_rows.DRAINING)


@router.post("/{node_id}/activate", dependencies=[Depends(require_node_token)])
async def activate_node(node_id: str, ctx: Context) -> NodeOut:
    """Place sandboxes on the node again (undoes a drain); idempotent. Raises as drain."""
    return await _set_state(ctx, node_id, node_rows.ACTIVE)


async def _set_state(ctx: ControlContext, node_id: str, state: str) -> NodeOut:
    record = await ctx.db.run(lambda s: node_rows.set_node_state(s, node_id, state))
    if record is None:
        raise ApiError("not_found", f"no node {node_id!r}", node_id=node_id)
    if record.state != state:
        raise ApiError(
            "conflict", f"node {node_id!r} is {record.state}", node_id=node_id, state=record.state
        )
    return await _node(ctx, record)


async def _node(ctx: ControlContext, record: node_rows.NodeRecord) -> NodeOut:
    out = NodeOut(
        node_id=record.id,
        url=record.url,
        state=record.state,
        lease_expires_at=record.lease_expires_at,
        last_seen=record.last_seen,
        reported=None if record.capacity is None else NodeCapacity(**record.capacity),
        reachable=False,
    )
    if record.state == node_rows.LOST or record.id not in ctx.nodes:
        return out
    try:
        async with asyncio.timeout(NODE_INFO_TIMEOUT_S):
            info = await ctx.nodes.get(record.id).info()
    except (NodeError, ApiError, TimeoutError) as exc:
        log.warning("nodes: node %s did not answer: %s", record.id, str(exc) or type(exc).__name__)
        return out
    return out.model_copy(
        update={"reachable": True, "sandboxes": info.sandboxes, "capacity": info.capacity}
    )
