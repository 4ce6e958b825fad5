"""Templates built once and shipped to the other nodes (issue 19).

A template is built on one node (space.control.routers.templates) and its build shipped
to the others: the target pulls it from the source (``import_template`` with the ticket
of the source's ``export_template``: checksummed, incremental against a build both
hold, its ready state made on the target; a failure leaves nothing there). Right after
a build, that runs in the background of the build's response (``ship_after_build``);
and every round a background job (space.control.background, under its job lease) gives
each active node the newest build of every tag that any active node holds and it lacks
(``ship_round``): a node that joins or comes back gets them, and a shipment that failed
is tried again (logged). Embedded nodes neither send nor receive (no other node
reaches them): they build for themselves.

Which build a tag names across the cluster: the newest (``created_at``) that a node
holds. A node moves a tag only forward (space.node.agent._shipping), so rounds
converge whatever order shipments land in. Until a node has a template, placement
prefers the nodes that have it (space.control.scheduler), and a create that a node
refuses for want of the template is asked of the next (space.control.lifecycle).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.nodes import LOCAL_URL
from space.control.store import nodes as node_rows
from space.control.template_names import BASE
from space.node.api import NodeError, TemplateImport, TemplateInfo

__all__ = ["LIST_TIMEOUT_S", "plan", "ship_after_build", "ship_round", "ship_template"]

log = logging.getLogger(__name__)

#: How long a node may take to list its templates before a round leaves it out.
LIST_TIMEOUT_S = 30.0


async def ship_template(
    ctx: ControlContext, ref: str, source_id: str, target_id: str
) -> TemplateImport:
    """Ship the build ``ref`` (the node's name, ``name@digest``) from node ``source_id``
    to ``target_id``; returns it there. Raises the NodeError of the node that failed
    (nothing of it is then on the target), ApiError(unavailable) for a node not
    registered. Idempotent."""
    ticket = await ctx.nodes.get(source_id).export_template(ref)
    source_url = ctx.nodes.url(source_id)
    result = await ctx.nodes.get(target_id).import_template(ticket, source_url)
    how = "already there" if not result.stream_bytes else (
        "full" if result.parent is None else "incremental"
    )  # fmt: skip
    log.info(
        "shipped template %s from %s to %s (%d bytes, %s)",
        ref, source_id, target_id, result.stream_bytes, how,
    )  # fmt: skip
    return result


@dataclass
class _Build:
    """One build some node holds: which tags it is the newest of, and where it is."""

    info: TemplateInfo
    tags: set[str] = field(default_factory=set)
    holders: list[str] = field(default_factory=list)

    @property
    def ref(self) -> str:
        return f"{self.info.name}@{self.info.digest}"


def plan(holdings: dict[str, list[TemplateInfo]]) -> list[tuple[str, str, str]]:
    """What to ship, as (``name@digest``, source, target), oldest build first (so a
    build's base arrives before it, and its stream is incremental against it): for
    every node of ``holdings`` (node id to its templates) and every tag another node
    holds, the newest build of that tag, unless the node has it under that tag."""
    builds: dict[tuple[str, str], _Build] = {}  # by (name, digest)
    newest: dict[tuple[str, str], TemplateInfo] = {}
    for node_id in sorted(holdings):
        for info in holdings[node_id]:
            if info.name == BASE:
                continue
            build = builds.setdefault((info.name, info.digest), _Build(info))
            if node_id not in build.holders:
                build.holders.append(node_id)
            key = (info.name, info.tag)
            known = newest.get(key)
            if known is None or (known.created_at, known.digest) < (info.created_at, info.digest):
                newest[key] = info
    for (_name, tag), info in newest.items():
        builds[(info.name, info.digest)].tags.add(tag)
    shipments = []
    for build in sorted(builds.values(), key=lambda b: (b.info.created_at, b.info.digest)):
        for node_id in sorted(holdings) if build.tags else ():
            held = {(info.name, info.tag, info.digest) for info in holdings[node_id]}
            if all((build.info.name, tag, build.info.digest) in held for tag in build.tags):
                continue
            source = _source(holdings, build, node_id)
            if source is not None:
                shipments.append((build.ref, source, node_id))
    return shipments


def _source(holdings: dict[str, list[TemplateInfo]], build: _Build, target: str) -> str | None:
    """Which holder to ship ``build`` from to ``target``: one whose tags for it are all
    the tags it is the newest of (its ticket carries them), else any other holder."""
    others = [holder for holder in build.holders if holder != target]
    for holder in others:
        tags = {
            i.tag
            for i in holdings[holder]
            if (i.name, i.digest) == (build.info.name, build.info.digest)
        }
        if build.tags <= tags:
            return holder
    return others[0] if others else None


async def ship_round(
    ctx: ControlContext, *, only: str | None = None, budget_s: float | None = None
) -> list[tuple[str, str]]:
    """Give every active node that other nodes reach the builds it lacks (``plan``;
    ``only``: of that digest alone); returns (``name@digest``, target) of each
    shipped. A node that does not list its templates in LIST_TIMEOUT_S is left out of
    the round; a shipment that fails is logged and left for the next. With
    ``budget_s``, no shipment but the first starts once that long has passed since
    the round began (the rest wait for the next round): a round under a job lease
    must end before the lease runs out, or another replica starts the same shipments
    (harmless: a target takes a build once, but it costs a wait)."""
    started = time.monotonic()
    holdings = await _holdings(ctx, await _shipping_nodes(ctx))
    shipped, tried = [], 0
    for ref, source, target in plan(holdings):
        if only is not None and not ref.endswith("@" + only):
            continue
        if tried and budget_s is not None and time.monotonic() - started > budget_s:
            log.info("template shipping: the round's %.0f s are spent; the rest next", budget_s)
            break
        tried += 1
        try:
            await ship_template(ctx, ref, source, target)
        except (NodeError, ApiError) as exc:
            log.warning("template %s not shipped from %s to %s: %s", ref, source, target, exc)
            continue
        shipped.append((ref, target))
    return shipped


def ship_after_build(ctx: ControlContext, digest: str) -> None:
    """Ship the build ``digest`` to the other nodes in the background (a task of
    ``ctx``, cancelled when the app stops); what fails, the next ``ship_round`` does."""

    async def ship() -> None:
        try:
            await ship_round(ctx, only=digest)
        except Exception:
            log.exception("shipping template build %s failed", digest)

    task = asyncio.get_running_loop().create_task(ship())
    ctx.tasks.add(task)
    task.add_done_callback(ctx.tasks.discard)


async def _shipping_nodes(ctx: ControlContext) -> list[str]:
    """The active nodes that other nodes reach (not embedded), registered here."""
    records = await ctx.db.read(node_rows.list_nodes)
    reachable = set(ctx.nodes.ids())
    return [
        r.id
        for r in records
        if r.state == node_rows.ACTIVE and r.id in reachable and ctx.nodes.url(r.id) != LOCAL_URL
    ]


async def _holdings(ctx: ControlContext, node_ids: list[str]) -> dict[str, list[TemplateInfo]]:
    holdings = {}
    for node_id in node_ids:
        try:
            async with asyncio.timeout(LIST_TIMEOUT_S):
                holdings[node_id] = await ctx.nodes.get(node_id).list_templates()
        except (NodeError, ApiError, TimeoutError) as exc:
            log.warning("node %s did not list its templates: %r", node_id, exc)
    return holdings
