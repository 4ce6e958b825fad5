"""``/v1/pools``: the warm pools of every registered node (issue 4).

Pools hold no tenant data; a tenant sees the pools of ``base`` and of its own
templates, in its own names.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from fastapi import APIRouter

from space.control.deps import Context, ControlContext, Tenant
from space.control.errors import ApiError
from space.control.schemas import PoolOut
from space.control.template_names import tenant_name
from space.node.api import NodeError, PoolInfo

__all__ = ["NODE_INFO_TIMEOUT_S", "router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/pools", tags=["pools"])

#: How long one node may take to report its pools before the listing goes on without
#: it: one slow node must not hold up the answer for the others.
NODE_INFO_TIMEOUT_S = 5.0


@router.get("")
async def list_pools(tenant: Tenant, ctx: Context) -> dict[str, list[PoolOut]]:
    """Every node's pools, by node id then template; nodes are asked concurrently.

    A node that fails to answer (unreachable, malformed answer, slower than
    NODE_INFO_TIMEOUT_S) is left out and logged, so the answer is never an error
    because of a node. Read-only and side-effect free.
    """
    async with asyncio.TaskGroup() as group:
        tasks = [
            group.create_task(_node_pools(ctx, node_id, tenant)) for node_id in ctx.nodes.ids()
        ]
    pools = [pool for task in tasks for pool in task.result()]
    return {"pools": sorted(pools, key=lambda pool: (pool.node_id, pool.template))}


async def _node_pools(ctx: ControlContext, node_id: str, tenant: str) -> list[PoolOut]:
    """The tenant's pools of one node; none (logged) if it does not answer in time."""
    try:
        async with asyncio.timeout(NODE_INFO_TIMEOUT_S):
            info = await ctx.nodes.get(node_id).info()
    except (NodeError, ApiError, TimeoutError) as exc:
        log.warning("pools: skipping node %s: %s", node_id, str(exc) or type(exc).__name__)
        return []
    visible = (_in_tenant_names(pool, tenant) for pool in info.pools)
    return [PoolOut.of(node_id, pool) for pool in visible if pool is not None]


def _in_tenant_names(pool: PoolInfo, tenant: str) -> PoolInfo | None:
    """``pool`` (of ``name:tag``) named as the tenant knows it; None if not theirs."""
    name, _, tag = pool.template.partition(":")
    mine = tenant_name(tenant, name)
    if mine is None:
        return None
    return replace(pool, template=f"{mine}:{tag}" if tag else mine)
