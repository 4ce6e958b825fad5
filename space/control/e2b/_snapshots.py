"""E2B's fork, snapshot and metrics routes, on space.control.snapshots and the samples
our ``/v1`` metrics route reads (space.control.routers.metrics).

A snapshot's E2B id is its SPACE id (``sn-...``): ``Sandbox.create`` takes it as the
template (space.control.e2b._sandboxes), and ``Sandbox.delete_snapshot`` deletes it
through E2B's template route, the only template E2B's API deletes here.
"""

from __future__ import annotations

import functools
import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response
from fastapi.responses import JSONResponse

from space.control import snapshots
from space.control.deps import Context, Tenant
from space.control.e2b._errors import E2BError, E2BRoute
from space.control.e2b._sandboxes import MAX_PAGE, SNAPSHOT_ID, E2BSandbox, set_timeout_of
from space.control.e2b._shapes import (
    E2BFork,
    E2BSnapshot,
    created_sandbox,
    e2b_state,
    metric,
    snapshot_info,
)
from space.control.idempotency import HEADER, idempotency
from space.control.routers.metrics import UnixSeconds, kept_samples, within
from space.control.store import repo
from space.control.store import snapshots as snaps

__all__ = ["router"]

router = APIRouter(route_class=E2BRoute, tags=["e2b"])

#: The most sandboxes one ``GET /sandboxes/metrics`` asks about.
MAX_METRICS_IDS = 100


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork_sandbox(
    sandbox: E2BSandbox,
    ctx: Context,
    body: E2BFork | None = None,
    idempotency_key: Annotated[str | None, Header(alias=HEADER)] = None,
) -> list[dict[str, Any]]:
    """``count`` running copies (SPACE's fork); each ends ``timeout`` seconds from now if
    given, else keeps its parent's timeouts."""
    body = body or E2BFork.model_validate({})
    asked = {"count": body.count, "timeout": body.timeout}
    idem = idempotency(idempotency_key, sandbox.tenant_id, "e2b-fork", sandbox.id, asked)
    children = await snapshots.fork_sandbox(ctx, sandbox, body.count, idem)
    if body.timeout is not None:
        for child in children:
            await set_timeout_of(ctx, child, body.timeout)
    return [{"sandbox": created_sandbox(ctx, child)} for child in children]


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def create_snapshot(
    sandbox: E2BSandbox, ctx: Context, body: E2BSnapshot | None = None
) -> dict[str, Any]:
    """SPACE's snapshot (disk and memory), named ``name`` or a new ``snapshot-<hex>``."""
    body = body or E2BSnapshot.model_validate({})
    if not body.memory:
        raise E2BError(400, "memory: false (filesystem-only snapshot) is not supported by SPACE")
    name = body.name or f"snapshot-{secrets.token_hex(6)}"
    return snapshot_info(await snapshots.take_snapshot(ctx, sandbox, name))


@router.get("/snapshots")
async def list_snapshots(
    tenant: Tenant,
    ctx: Context,
    sandboxID: Annotated[str | None, Query(max_length=64)] = None,
    name: Annotated[str | None, Query(max_length=64)] = None,
    nextToken: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
) -> Response:
    """The tenant's snapshots, oldest first, a page at a time (``x-next-token``: the
    last snapshot id of the page)."""
    records = await ctx.db.run(lambda s: snaps.list_snapshots(s, tenant, sandbox_id=sandboxID))
    kept = [r for r in records if name is None or r.name == name]
    if nextToken:
        ids = [r.id for r in kept]
        if nextToken not in ids:
            raise E2BError(400, "nextToken is not a token this API gave")
        kept = kept[ids.index(nextToken) + 1 :]
    page = kept[:limit]
    headers = {"x-next-token": page[-1].id} if len(kept) > limit else None
    return JSONResponse([snapshot_info(r) for r in page], headers=headers)


@router.delete("/templates/{template_id}", status_code=204)
async def delete_snapshot(template_id: str, tenant: Tenant, ctx: Context) -> Response:
    """Delete one of the tenant's snapshots; 404 once deleted (the SDK's False). One
    whose deletion failed half-way is deleted again."""
    if not SNAPSHOT_ID.fullmatch(template_id):
        raise E2BError(404, f"no snapshot {template_id!r}: SPACE's E2B API deletes only snapshots")
    record = await ctx.db.run(
        lambda s: snaps.find_snapshot(s, tenant, template_id, include_deleted=True)
    )
    if record is None or record.state == snaps.DELETED:
        raise E2BError(404, f"no snapshot {template_id!r}")
    await snapshots.delete_snapshot(ctx, record)
    return Response(status_code=204)


@router.get("/sandboxes/metrics")
async def latest_metrics(
    tenant: Tenant,
    ctx: Context,
    sandbox_ids: Annotated[str, Query(max_length=MAX_METRICS_IDS * 64)],
) -> dict[str, Any]:
    """The latest sample of each of the tenant's sandboxes named (others left out)."""
    ids = [i for i in sandbox_ids.split(",") if i][:MAX_METRICS_IDS]
    latest: dict[str, Any] = {}
    for sandbox_id in dict.fromkeys(ids):
        record = await ctx.db.run(
            functools.partial(repo.find_sandbox, tenant_id=tenant, sandbox_id=sandbox_id)
        )
        if record is None or e2b_state(record) is None:
            continue
        samples = await kept_samples(ctx, record)
        if samples:
            latest[sandbox_id] = metric(samples[-1])
    return {"sandboxes": latest}


@router.get("/sandboxes/{sandbox_id}/metrics")
async def sandbox_metrics(
    sandbox: E2BSandbox, ctx: Context, start: UnixSeconds = None, end: UnixSeconds = None
) -> list[dict[str, Any]]:
    """The kept samples between ``start`` and ``end`` (Unix seconds), oldest first."""
    samples = await kept_samples(ctx, sandbox)
    return [metric(s) for s in samples if within(s, start, end)]
