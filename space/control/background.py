"""A control-plane replica's background work (issue 19).

Every replica runs the same loop, a round every ``reaper_interval_s``. What each
replica must do for itself runs in each:
- heartbeat the nodes embedded in its own process (a remote node agent sends its own);
- learn the nodes other replicas registered, and which are lost, from the database;
- keep the sandboxes it streams from marked active, so that no replica's reaper takes
  a sandbox with a silent command open for idle.

What must happen once runs only in the replica holding that job's lease
(space.control.store.job_leases), taken again each round: marking lost the nodes whose
lease ran out (and their sandboxes), the reaper (space.control.reconcile.reap), moving
suspended sandboxes off draining nodes (space.control.moves), shipping each node the
template builds it lacks (space.control.shipping: a node that joined or came back gets
them), the artifact store's work (space.control.archives: uploads, waking lost
sandboxes elsewhere from it, deleting stale bundles), and reconciling every node with
the database every ``reconcile_interval_s``. A replica that dies stops renewing;
another takes its jobs within ``job_lease_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy.orm import Session

from space.control.archives import archive_round, rehome_round
from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.moves import drain_round
from space.control.nodes import LOCAL_URL, capacity_report
from space.control.reconcile import reap, reconcile, reconcile_node
from space.control.schemas import NodeCapacity
from space.control.shipping import ship_round
from space.control.store import job_leases
from space.control.store import nodes as node_rows
from space.node.api import NodeError

__all__ = [
    "INFO_TIMEOUT_S",
    "background_loop",
    "background_round",
    "heartbeat_embedded",
    "job_lease_s",
    "record_heartbeat",
    "refresh_nodes",
    "release_jobs",
    "start",
]

log = logging.getLogger(__name__)

#: How long an embedded node may take to report itself before its heartbeat is skipped.
INFO_TIMEOUT_S = 10.0
#: A job lease never runs out sooner than this: a round that calls slow nodes must
#: finish before another replica may take the job.
_MIN_JOB_LEASE_S = 15.0
_NODE_LEASES, _REAPER, _RECONCILE = "node-leases", "reaper", "reconcile"
_DRAIN, _SHIP, _ARCHIVES = "drain", "ship-templates", "archives"


async def start(ctx: ControlContext) -> None:
    """Before the first request: record the embedded nodes and heartbeat them, attach
    the remote ones, and reconcile every node unless another replica holds that job
    (on SQLite settling every half-made row at once: no other replica can be making
    it)."""
    embedded, now = ctx.nodes.embedded(), ctx.clock()

    def record(session: Session) -> None:
        for node_id in embedded:
            node_rows.heartbeat(session, node_id, LOCAL_URL, now)

    await ctx.db.run(record)
    await heartbeat_embedded(ctx)
    await refresh_nodes(ctx)
    # On SQLite this is the only replica (a file database is no replica's to share): the
    # leases a crashed predecessor held are nobody's, and nothing is in flight yet, so
    # what is half made, a crash left.
    alone = ctx.db.dialect == "sqlite"
    if alone:
        await ctx.db.run(job_leases.clear)
    if await _holds(ctx, _RECONCILE):
        await reconcile(ctx, grace_s=0.0 if alone else None)


def job_lease_s(interval_s: float) -> float:
    """How long a job's lease lasts: three rounds, and at least _MIN_JOB_LEASE_S."""
    return max(3 * interval_s, _MIN_JOB_LEASE_S)


async def background_loop(ctx: ControlContext) -> None:
    """Run a round every ``reaper_interval_s`` until cancelled, the first one interval
    after the start (``start`` has done a round's node work); a failing round is
    logged. Reconciliation is due every ``reconcile_interval_s``."""
    settings = ctx.settings
    reconcile_due = time.monotonic() + settings.reconcile_interval_s
    while True:
        await asyncio.sleep(settings.reaper_interval_s)
        due = time.monotonic() >= reconcile_due
        try:
            await background_round(ctx, reconcile_nodes=due)
        except Exception:
            log.exception("background round failed")
        if due:
            reconcile_due = time.monotonic() + settings.reconcile_interval_s


async def background_round(ctx: ControlContext, *, reconcile_nodes: bool = False) -> None:
    """One round (the module docstring): this replica's own work, then each job whose
    lease it holds."""
    await heartbeat_embedded(ctx)
    await refresh_nodes(ctx)
    await ctx.activity.mark_streamed()
    if await _holds(ctx, _NODE_LEASES):
        now = ctx.clock()
        lost = await ctx.db.run(lambda s: node_rows.expire_leases(s, now))
        for node_id, sandbox_ids in lost.items():
            log.warning("node %s lost its lease; its sandboxes are lost: %s", node_id, sandbox_ids)
        if lost:
            await refresh_nodes(ctx)
    if await _holds(ctx, _REAPER):
        await reap(ctx)
    if await _holds(ctx, _DRAIN):
        await drain_round(ctx)
    budget_s = job_lease_s(ctx.settings.reaper_interval_s) / 2  # a round ends inside its lease
    if await _holds(ctx, _SHIP):
        await ship_round(ctx, budget_s=budget_s)
    if await _holds(ctx, _ARCHIVES):
        await rehome_round(ctx)
        await archive_round(ctx, budget_s=budget_s)
    if reconcile_nodes and await _holds(ctx, _RECONCILE):
        await reconcile(ctx)


async def _holds(ctx: ControlContext, job: str) -> bool:
    """Whether this replica holds ``job``'s lease now. It is renewed (a write) only once
    a quarter of it has run: no other replica can take a lease before it runs out, so
    one held with three quarters left needs no write, and a job starting then still
    ends its round's budget (half a lease) inside it. A lease lost is asked for again
    every round."""
    now, ttl = ctx.clock(), job_lease_s(ctx.settings.reaper_interval_s)
    if ctx.held_jobs.get(job, now) - now > 0.75 * ttl:
        return True
    held = await ctx.db.run(lambda s: job_leases.take(s, job, ctx.replica_id, now, ttl))
    if held:
        ctx.held_jobs[job] = now + ttl
    else:
        ctx.held_jobs.pop(job, None)
    return held


async def release_jobs(ctx: ControlContext) -> None:
    """Give up this replica's job leases (at shutdown: another replica takes them at
    its next round)."""
    ctx.held_jobs.clear()
    await ctx.db.run(lambda s: job_leases.release(s, ctx.replica_id))


async def heartbeat_embedded(ctx: ControlContext) -> None:
    """Renew the lease of every node embedded in this replica, with its capacity; a
    node that comes back from lost is reconciled. One that does not answer in
    INFO_TIMEOUT_S is skipped (logged): its lease runs on towards lost."""
    for node_id in ctx.nodes.embedded():
        try:
            async with asyncio.timeout(INFO_TIMEOUT_S):
                info = await ctx.nodes.get(node_id).info()
        except (NodeError, ApiError, TimeoutError) as exc:
            log.warning("embedded node %s did not report itself: %r", node_id, exc)
            continue
        await record_heartbeat(ctx, node_id, LOCAL_URL, capacity_report(info))


async def record_heartbeat(
    ctx: ControlContext,
    node_id: str,
    url: str,
    capacity: NodeCapacity | None,
    *,
    lease: bool = True,
) -> None:
    """Record the node seen now with ``capacity`` and, with ``lease``, renew its lease;
    a node that was lost until now is reconciled."""
    now, lease_s = ctx.clock(), ctx.settings.node_lease_s if lease else None
    figures = None if capacity is None else capacity.model_dump()
    back = await ctx.db.run(
        lambda s: node_rows.heartbeat(s, node_id, url, now, lease_s=lease_s, capacity=figures)
    )
    if back:
        await _came_back(ctx, node_id)


async def _came_back(ctx: ControlContext, node_id: str) -> None:
    """A lost node heartbeats again: its sandboxes take the states it reports."""
    log.info("node %s is back", node_id)
    ctx.nodes.set_lost(ctx.nodes.lost - {node_id})
    try:
        await reconcile_node(ctx, node_id)
    except (NodeError, ApiError) as exc:
        log.warning("could not reconcile node %s, back from lost: %s", node_id, exc)


async def refresh_nodes(ctx: ControlContext) -> None:
    """Attach the remote nodes the database knows and this replica does not (another
    replica registered them), and tell the registry which nodes are lost."""
    records = await ctx.db.read(node_rows.list_nodes)
    for record in records:
        if record.url != LOCAL_URL and ctx.nodes.url_of(record.id) != record.url:
            await ctx.nodes.register_remote(record.id, record.url, ctx.node_token)
    ctx.nodes.set_lost({record.id for record in records if record.state == node_rows.LOST})
