"""The platform's Prometheus metrics (issue 20): ``GET /metrics`` on every replica.

Two kinds, and where each comes from:

- **Histograms of this replica's own requests** (space.control.instruments, one set
  per app):
  ``space_sandbox_create_seconds{source}`` (the node's create or fork call, by
  ``source`` template, snapshot or fork; one observation per sandbox made) and
  ``space_exec_start_seconds`` (from asking the node to run a command to the process
  running). Each replica exposes its own; Prometheus sums them across replicas.
- **Read at scrape time**: gauges ``space_sandboxes{state}`` and ``space_nodes{state}``
  from the database all replicas share (so every replica answers the same), and per
  node ``space_pool_hits_total`` / ``space_pool_misses_total{node,template}`` and
  ``space_egress_decisions_total{node,decision}``, counters the nodes keep (they
  restart from 0 with a node agent or its egress gateway, which Prometheus' ``rate``
  understands). Nodes are asked concurrently, each for at most NODE_SCRAPE_TIMEOUT_S: a
  node that does not answer in time is left out of that scrape and counted in
  ``space_scrape_node_failures``.

The route takes the operator's node token (``Authorization: Bearer``), as ``GET
/v1/nodes`` does: Prometheus' ``bearer_token_file``. Names and labels are in
docs/api.md ("Platform metrics").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from space.control.deps import Context, ControlContext, require_node_token
from space.control.errors import ApiError
from space.control.store import counts, nodes
from space.node.api import EGRESS_DECISIONS, NodeError, NodeInfo, SandboxState

__all__ = ["NODE_SCRAPE_TIMEOUT_S", "router", "scrape"]

log = logging.getLogger(__name__)

#: How long one node may take to report its counters before the scrape goes on without
#: it: Prometheus' default scrape timeout is 10 s, and a scrape waits for the slowest.
NODE_SCRAPE_TIMEOUT_S = 2.0
_NODE_STATES = (nodes.ACTIVE, nodes.DRAINING, nodes.LOST)

router = APIRouter(tags=["metrics"])


@dataclass
class _Scrape:
    """What one scrape read from the database and the nodes."""

    sandboxes: dict[str, int]
    nodes: dict[str, int]
    infos: dict[str, NodeInfo] = field(default_factory=dict)
    failures: int = 0


class _ScrapeCollector(Collector):
    def __init__(self, scrape: _Scrape) -> None:
        self._scrape = scrape

    def collect(self) -> Iterator[Metric]:
        scrape = self._scrape
        sandboxes = GaugeMetricFamily("space_sandboxes", "Sandboxes by state.", labels=["state"])
        for state in SandboxState:
            if state is not SandboxState.DELETED:
                sandboxes.add_metric([state.value], scrape.sandboxes.get(state.value, 0))
        yield sandboxes
        gauge = GaugeMetricFamily("space_nodes", "Registered nodes by state.", labels=["state"])
        for name in sorted({*_NODE_STATES, *scrape.nodes}):
            gauge.add_metric([name], scrape.nodes.get(name, 0))
        yield gauge
        yield from _pool_counters(scrape.infos)
        decisions = CounterMetricFamily(
            "space_egress_decisions",
            "Egress decisions of the node's gateway since it started, by decision.",
            labels=["node", "decision"],
        )
        for node_id, info in sorted(scrape.infos.items()):
            for decision in EGRESS_DECISIONS:
                decisions.add_metric([node_id, decision], info.egress_decisions.get(decision, 0))
        yield decisions
        failures = GaugeMetricFamily(
            "space_scrape_node_failures",
            f"Nodes that did not report within {NODE_SCRAPE_TIMEOUT_S} s in this scrape.",
        )
        failures.add_metric([], scrape.failures)
        yield failures


def _pool_counters(infos: dict[str, NodeInfo]) -> Iterator[Metric]:
    labels = ["node", "template"]
    hits = CounterMetricFamily(
        "space_pool_hits", "Creates a node's warm pool served.", labels=labels
    )
    misses = CounterMetricFamily(
        "space_pool_misses",
        "Creates of a warm pool's shape that it could not serve.",
        labels=labels,
    )
    for node_id, info in sorted(infos.items()):
        for pool in sorted(info.pools, key=lambda pool: pool.template):
            hits.add_metric([node_id, pool.template], pool.hits)
            misses.add_metric([node_id, pool.template], pool.misses)
    yield hits
    yield misses


async def _node_info(ctx: ControlContext, node_id: str) -> NodeInfo | None:
    try:
        async with asyncio.timeout(NODE_SCRAPE_TIMEOUT_S):
            return await ctx.nodes.get(node_id).info()
    except (NodeError, ApiError, TimeoutError) as exc:
        log.info("metrics: node %s did not report: %s", node_id, str(exc) or type(exc).__name__)
        return None


async def scrape(ctx: ControlContext) -> bytes:
    """The exposition text: this replica's histograms, then what it read now."""
    by_state = await ctx.db.run(counts.sandboxes_by_state)
    nodes_by_state = await ctx.db.run(counts.nodes_by_state)
    node_ids = sorted(ctx.nodes.ids())
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(_node_info(ctx, node_id)) for node_id in node_ids]
    found = _Scrape(by_state, nodes_by_state)
    for node_id, task in zip(node_ids, tasks, strict=True):
        info = task.result()
        if info is None:
            found.failures += 1
        else:
            found.infos[node_id] = info
    now = CollectorRegistry()
    now.register(_ScrapeCollector(found))
    return generate_latest(ctx.metrics.registry) + generate_latest(now)


@router.get("/metrics", dependencies=[Depends(require_node_token)], include_in_schema=False)
async def metrics(ctx: Context) -> Response:
    """The platform's metrics in Prometheus' text format (node token required)."""
    return Response(await scrape(ctx), media_type=CONTENT_TYPE_LATEST)
