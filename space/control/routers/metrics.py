"""``GET /v1/sandboxes/{id}/metrics``: a sandbox's recent CPU, memory and disk samples.

The samples come from the sandbox's node (space.node.api.NodeService.sandbox_metrics),
which samples a running guest at most every METRICS_INTERVAL_S and keeps the last
MAX_METRICS_SAMPLES. Reading metrics never wakes a sandbox and never counts as activity
(a dashboard polling it must not keep a sandbox from its idle timeout): a paused or
hibernated sandbox answers the samples its node kept, any other state none.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Query

from space.control.deps import Context, ControlContext, Sandbox
from space.control.errors import ApiError
from space.control.schemas import SandboxMetricOut, SandboxMetricsOut
from space.control.store import repo
from space.node.api import NodeError, SandboxMetrics, SandboxState

__all__ = ["UnixSeconds", "kept_samples", "router", "within"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", tags=["metrics"])

#: States whose node holds samples of the sandbox; asleep ones are never woken.
_ASLEEP = frozenset({SandboxState.PAUSED.value, SandboxState.HIBERNATED.value})
#: Unix seconds, as E2B's ``start`` and ``end`` (0 to the year 2200).
UnixSeconds = Annotated[int | None, Query(ge=0, le=7_289_654_400)]


@router.get("/metrics")
async def sandbox_metrics(
    sandbox: Sandbox, ctx: Context, start: UnixSeconds = None, end: UnixSeconds = None
) -> SandboxMetricsOut:
    """The kept samples with ``start <= timestamp <= end`` (both optional), oldest first."""
    samples = await kept_samples(ctx, sandbox)
    kept = [s for s in samples if within(s, start, end)]
    return SandboxMetricsOut(metrics=[SandboxMetricOut.of(sample) for sample in kept])


async def kept_samples(ctx: ControlContext, sandbox: repo.SandboxRecord) -> list[SandboxMetrics]:
    """The samples the sandbox's node keeps, oldest first; none for a sandbox asleep
    whose node has none (the E2B API reads them too)."""
    if sandbox.state == repo.RUNNING:
        return await ctx.nodes.get(sandbox.node_id).sandbox_metrics(sandbox.id)
    if sandbox.state not in _ASLEEP:
        return []
    try:
        return await ctx.nodes.get(sandbox.node_id).sandbox_metrics(sandbox.id)
    except (NodeError, ApiError) as exc:  # asleep, maybe archived off its node: nothing kept then
        log.info("sandbox %s: no metrics from node %s: %s", sandbox.id, sandbox.node_id, exc)
        return []


def within(sample: SandboxMetrics, start: int | None, end: int | None) -> bool:
    second = int(sample.timestamp)  # the bounds are whole seconds, as timestamp_unix
    return (start is None or second >= start) and (end is None or second <= end)
