"""``/v1/sandboxes/{id}/snapshots`` and ``/v1/snapshots``: take, list, get, delete."""

from __future__ import annotations

from fastapi import APIRouter, Response

from space.control import snapshots
from space.control.deps import Context, Sandbox, Tenant
from space.control.errors import ApiError
from space.control.schemas import SnapshotCreate, SnapshotOut
from space.control.store import snapshots as snaps

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["snapshots"])


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def take_snapshot(body: SnapshotCreate, sandbox: Sandbox, ctx: Context) -> SnapshotOut:
    """Snapshot the sandbox (running, paused or hibernated; it keeps its state)."""
    return SnapshotOut.of(await snapshots.take_snapshot(ctx, sandbox, body.name))


@router.get("/sandboxes/{sandbox_id}/snapshots")
async def list_sandbox_snapshots(sandbox: Sandbox, ctx: Context) -> dict[str, list[SnapshotOut]]:
    """The snapshots taken of this sandbox, oldest first."""
    records = await ctx.db.run(
        lambda s: snaps.list_snapshots(s, sandbox.tenant_id, sandbox_id=sandbox.id)
    )
    return {"snapshots": [SnapshotOut.of(record) for record in records]}


@router.get("/snapshots")
async def list_snapshots(tenant: Tenant, ctx: Context) -> dict[str, list[SnapshotOut]]:
    """All the tenant's snapshots, oldest first (a forest: follow ``parent_id``)."""
    records = await ctx.db.run(lambda s: snaps.list_snapshots(s, tenant))
    return {"snapshots": [SnapshotOut.of(record) for record in records]}


@router.get("/snapshots/{snapshot_id}")
async def get_snapshot(snapshot_id: str, tenant: Tenant, ctx: Context) -> SnapshotOut:
    """The snapshot, with ``exclusive_bytes`` measured by its node."""
    record = await snapshots.find_snapshot(ctx, tenant, snapshot_id)
    return SnapshotOut.of(record, await snapshots.measure_snapshot(ctx, record))


@router.delete("/snapshots/{snapshot_id}", status_code=204)
async def delete_snapshot(snapshot_id: str, tenant: Tenant, ctx: Context) -> Response:
    """Idempotent: deleting an already deleted snapshot of the tenant answers 204 again."""
    record = await ctx.db.run(
        lambda s: snaps.find_snapshot(s, tenant, snapshot_id, include_deleted=True)
    )
    if record is None:
        raise ApiError("not_found", f"no snapshot {snapshot_id!r}", snapshot_id=snapshot_id)
    await snapshots.delete_snapshot(ctx, record)
    return Response(status_code=204)
