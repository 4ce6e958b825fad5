"""``/v1/sandboxes``: create, list, get, delete, pause, resume."""

from __future__ import annotations

from fastapi import APIRouter, Response

from space.control import lifecycle
from space.control.deps import Context, Sandbox, Tenant
from space.control.errors import ApiError
from space.control.schemas import SandboxCreate, SandboxOut
from space.control.store import repo

__all__ = ["router"]

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])


@router.post("", status_code=201)
async def create_sandbox(body: SandboxCreate, tenant: Tenant, ctx: Context) -> SandboxOut:
    given = "timeout_s" in body.model_fields_set
    record = await lifecycle.create_sandbox(ctx, tenant, body, timeout_given=given)
    return SandboxOut.of(record)


@router.get("")
async def list_sandboxes(tenant: Tenant, ctx: Context) -> dict[str, list[SandboxOut]]:
    records = await ctx.db.run(lambda s: repo.list_sandboxes(s, tenant))
    return {"sandboxes": [SandboxOut.of(record) for record in records]}


@router.get("/{sandbox_id}")
async def get_sandbox(sandbox_id: str, tenant: Tenant, ctx: Context) -> SandboxOut:
    record = await ctx.db.run(lambda s: repo.find_sandbox(s, tenant, sandbox_id))
    if record is None:
        raise ApiError("not_found", f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
    return SandboxOut.of(record)


@router.delete("/{sandbox_id}", status_code=204)
async def delete_sandbox(sandbox_id: str, tenant: Tenant, ctx: Context) -> Response:
    """Idempotent: deleting an already deleted sandbox of the tenant answers 204 again."""
    record = await ctx.db.run(
        lambda s: repo.find_sandbox(s, tenant, sandbox_id, include_deleted=True)
    )
    if record is None:
        raise ApiError("not_found", f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
    await lifecycle.delete_sandbox(ctx, record)
    return Response(status_code=204)


@router.post("/{sandbox_id}/pause")
async def pause_sandbox(sandbox: Sandbox, ctx: Context) -> SandboxOut:
    """Stop the sandbox's vCPUs, keeping its memory; idempotent (409 unless running or paused)."""
    return SandboxOut.of(await lifecycle.pause_sandbox(ctx, sandbox))


@router.post("/{sandbox_id}/resume")
async def resume_sandbox(sandbox: Sandbox, ctx: Context) -> SandboxOut:
    """Restart a paused sandbox; idempotent (409 unless running or paused)."""
    return SandboxOut.of(await lifecycle.resume_sandbox(ctx, sandbox))
