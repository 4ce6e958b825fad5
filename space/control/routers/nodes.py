"""``/v1/nodes``: node agents on other hosts register here with the node token."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Depends

from space.control.deps import Context, require_node_token
from space.control.reconcile import reconcile_node
from space.control.schemas import NodeRegistration
from space.control.store import repo
from space.node.api import NodeError

__all__ = ["router"]

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


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
