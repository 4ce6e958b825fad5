"""``/v1/sandboxes/{id}/egress``: a sandbox's egress policy and its audit log (issue 5).

Tenant-scoped like every sandbox route: another tenant's sandbox is 404. The policy is
the control plane's desired state (space.control.egress); the log is the node's.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query

from space.control import egress
from space.control.deps import Context, Sandbox
from space.control.schemas import EgressEventOut, EgressLogOut, policy_out

__all__ = ["router"]

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/egress", tags=["egress"])


@router.get("")
async def get_policy(sandbox: Sandbox) -> dict[str, Any]:
    """The sandbox's egress policy; ``{"allow": []}`` is no network."""
    return policy_out(sandbox.egress)


@router.put("")
async def set_policy(
    policy: Annotated[dict[str, Any], Body()], sandbox: Sandbox, ctx: Context
) -> dict[str, Any]:
    """Replace the policy (idempotent); answers it canonical.

    422 with the parser's message for a malformed policy (nothing changes). The row is
    written before the node is asked: a node error is answered with the new policy
    already recorded, and repeating the PUT pushes it again.
    """
    return await egress.set_policy(ctx, sandbox, policy)


@router.get("/log")
async def egress_log(
    sandbox: Sandbox,
    ctx: Context,
    limit: Annotated[int, Query(ge=1, le=egress.MAX_LOG_LIMIT)] = egress.DEFAULT_LOG_LIMIT,
) -> EgressLogOut:
    """The latest ``limit`` (1 to 1000) egress decisions, oldest first, and how many
    the node's audit dropped over the sandbox's write budget."""
    read = await egress.read_log(ctx, sandbox, limit)
    return EgressLogOut(
        events=[EgressEventOut.of(event) for event in read.events], dropped=read.dropped
    )
