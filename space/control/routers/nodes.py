"""``/v1/nodes``: node agents register here, and operators read their load and capacity;
both with the node token."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from space.control.deps import Context, ControlContext, require_node_token
from space.control.errors import ApiError
from space.control.reconcile import reconcile_node
from space.control.routers.pools import NODE_INFO_TIMEOUT_S
from space.control.schemas import NodeRegistration
from space.control.store import repo
from space.node.api import CapacityInfo, NodeError

__all__ = ["NodeOut", "router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


class NodeOut(BaseModel):
    """A registered node as an operator sees it (``GET /v1/nodes``)."""

    node_id: str
    #: Where the control plane reaches it (``local``: the embedded node).
    url: str
    #: False if it did not answer within NODE_INFO_TIMEOUT_S; what follows is then null.
    reachable: bool
    #: Its sandboxes, in any state.
    sandboxes: int | None = None
    #: What its admission decides from (space/node/core/capacity.py), ``room`` included:
    #: how many more default sandboxes it would admit now.
    capacity: CapacityInfo | None = None


@router.post("", dependencies=[Depends(require_node_token)])
async def register_node(body: NodeRegistration, ctx: Context) -> dict[str, str]:
    """Record the node and start placing sandboxes on it (idempotent per id and URL).

    Raises 409 for the embedded node's id; a node that cannot be reconciled right away
    is still registered (reconciliation is retried at the next start).
    """
    await ctx.nodes.register_remote(body.node_id, body.url, ctx.node_token)
    now = ctx.clock()
    await ctx.db.run(lambda s: repo.upsert_node(s, body.node_id, body.url, now))
    with contextlib.suppress(NodeError):
        await reconcile_node(ctx, body.node_id)
    return {"node_id": body.node_id, "url": body.url}


@router.get("", dependencies=[Depends(require_node_token)])
async def list_nodes(ctx: Context) -> dict[str, list[NodeOut]]:
    """Every registered node, by id, with its sandboxes and capacity figures; nodes are
    asked concurrently, and one that fails to answer in time is listed unreachable (and
    logged), never an error of the listing. Read-only."""
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(_node(ctx, node_id)) for node_id in ctx.nodes.ids()]
    return {"nodes": [task.result() for task in tasks]}


async def _node(ctx: ControlContext, node_id: str) -> NodeOut:
    url = ctx.nodes.url(node_id)
    try:
        async with asyncio.timeout(NODE_INFO_TIMEOUT_S):
            info = await ctx.nodes.get(node_id).info()
    except (NodeError, ApiError, TimeoutError) as exc:
        log.warning("nodes: node %s did not answer: %s", node_id, str(exc) or type(exc).__name__)
        return NodeOut(node_id=node_id, url=url, reachable=False)
    return NodeOut(
        node_id=node_id, url=url, reachable=True, sandboxes=info.sandboxes, capacity=info.capacity
    )
