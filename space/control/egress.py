"""Sandboxes' egress policies (issue 5): validated, recorded as desired state, pushed.

A policy is checked and made canonical by space.node.api.egress_policy (the node's own
parser, so the control plane never stores what a node would refuse) and kept in the
sandbox's row; None means no network at all. Changing it writes the row before the
node is asked, as every desired-state change does: if the node then fails, the row
keeps the new policy and the node's error is answered, and repeating the (idempotent)
change pushes it again.
"""

from __future__ import annotations

import logging
from typing import Any

from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.store import repo
from space.control.store.repo import SandboxRecord
from space.node.api import (
    MAX_EGRESS_LOG_EVENTS,
    EgressLog,
    EgressPolicy,
    InvalidArgument,
    NodeError,
    PolicyBounds,
)

__all__ = [
    "DEFAULT_LOG_LIMIT",
    "MAX_LOG_LIMIT",
    "canonical",
    "push_to_children",
    "read_log",
    "set_policy",
]

log = logging.getLogger(__name__)

#: How many egress events ``GET .../egress/log`` answers by default, and at most.
DEFAULT_LOG_LIMIT = 100
MAX_LOG_LIMIT = MAX_EGRESS_LOG_EVENTS


def canonical(data: object, bounds: PolicyBounds) -> dict[str, Any]:
    """The canonical JSON of the policy ``data`` (EgressPolicy.to_json).

    Raises ApiError(invalid_argument) carrying the parser's message for a malformed one
    or one naming what ``bounds`` (the operator's, ControlSettings.egress_bounds) refuse.
    """
    try:
        return EgressPolicy.parse(data, bounds).to_json()
    except InvalidArgument as exc:
        raise ApiError("invalid_argument", exc.message, field="egress") from None


async def set_policy(ctx: ControlContext, record: SandboxRecord, data: object) -> dict[str, Any]:
    """Replace ``record``'s egress policy with ``data``; returns the canonical policy.

    Idempotent. A malformed policy raises ApiError(invalid_argument) and changes
    nothing. The row is written first, then the node is asked: the node's NodeError is
    raised with the row already holding the new policy (repeat the call to push it).
    """
    policy = canonical(data, ctx.settings.egress_bounds)
    await ctx.db.run(lambda s: repo.set_egress(s, record.id, policy))
    await ctx.nodes.get(record.node_id).set_egress(record.id, policy)
    return policy


async def read_log(ctx: ControlContext, record: SandboxRecord, limit: int) -> EgressLog:
    """The sandbox's latest ``limit`` egress decisions, oldest first, and how many its
    audit dropped (node errors raised).

    Raises ApiError(invalid_argument) unless 1 <= limit <= MAX_LOG_LIMIT.
    """
    if not 1 <= limit <= MAX_LOG_LIMIT:
        message = f"limit must be 1 to {MAX_LOG_LIMIT}, got {limit}"
        raise ApiError("invalid_argument", message, sandbox_id=record.id)
    return await ctx.nodes.get(record.node_id).egress_log(record.id, limit=limit)


async def push_to_children(ctx: ControlContext, children: list[SandboxRecord]) -> None:
    """Push each fork child's policy (its parent's, in its row) to its node.

    Whether a node's fork copies the parent's policy is not part of NodeService's
    contract, so the control plane states it. A child the node refuses is logged and
    kept: its row holds the policy, and a node without one gives no network at all.
    """
    for child in children:
        try:
            await ctx.nodes.get(child.node_id).set_egress(child.id, child.egress)
        except (NodeError, ApiError) as exc:
            log.warning("could not set the egress policy of fork child %s: %s", child.id, exc)
