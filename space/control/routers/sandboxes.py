"""``/v1/sandboxes``: create, list, get, delete, pause, hibernate, resume, timeouts,
ports, restore, fork."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Response

from space.control import lifecycle, ports, snapshots
from space.control.deps import Context, ControlContext, Sandbox, Tenant
from space.control.errors import ApiError
from space.control.idempotency import HEADER, idempotency
from space.control.schemas import (
    ForkBody,
    PortsBody,
    RestoreBody,
    SandboxCreate,
    SandboxOut,
    TimeoutsBody,
)
from space.control.store import repo
from space.control.store.repo import SandboxRecord

__all__ = ["router"]

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])

#: The optional ``Idempotency-Key`` of a create or fork (space.control.idempotency).
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias=HEADER,
        description="Retries with this key (1-255 printable ASCII characters, kept 24 h)"
        " answer what the first request made instead of making more.",
    ),
]


def _out(ctx: ControlContext, record: SandboxRecord) -> SandboxOut:
    return SandboxOut.of(ctx.activity.latest(record), ports.ports_out(ctx, record))


@router.post("", status_code=201)
async def create_sandbox(
    body: SandboxCreate, tenant: Tenant, ctx: Context, idempotency_key: IdempotencyKey = None
) -> SandboxOut:
    """Create a sandbox; idempotent with an ``Idempotency-Key``."""
    given = "timeout_s" in body.model_fields_set
    asked = body.model_dump(mode="json", exclude_unset=True)
    idem = idempotency(idempotency_key, tenant, "create", None, asked)
    record = await lifecycle.create_sandbox(ctx, tenant, body, timeout_given=given, idem=idem)
    return _out(ctx, record)


@router.get("")
async def list_sandboxes(tenant: Tenant, ctx: Context) -> dict[str, list[SandboxOut]]:
    records = await ctx.db.read(lambda s: repo.list_sandboxes(s, tenant))
    return {"sandboxes": [_out(ctx, record) for record in records]}


@router.get("/{sandbox_id}")
async def get_sandbox(sandbox_id: str, tenant: Tenant, ctx: Context) -> SandboxOut:
    record = await ctx.db.read(lambda s: repo.find_sandbox(s, tenant, sandbox_id))
    if record is None:
        raise ApiError("not_found", f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
    return _out(ctx, record)


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
    return _out(ctx, await lifecycle.pause_sandbox(ctx, sandbox))


@router.post("/{sandbox_id}/hibernate")
async def hibernate_sandbox(sandbox: Sandbox, ctx: Context) -> SandboxOut:
    """Save memory to disk and stop the VM; idempotent (409 unless running, paused or
    hibernated)."""
    return _out(ctx, await lifecycle.hibernate_sandbox(ctx, sandbox))


@router.post("/{sandbox_id}/resume")
async def resume_sandbox(sandbox: Sandbox, ctx: Context) -> SandboxOut:
    """Restart a paused or hibernated sandbox; idempotent (409 unless running, paused or
    hibernated)."""
    return _out(ctx, await lifecycle.resume_sandbox(ctx, sandbox))


@router.put("/{sandbox_id}/timeouts")
async def set_timeouts(body: TimeoutsBody, sandbox: Sandbox, ctx: Context) -> SandboxOut:
    """Change the idle timeout and/or the lifetime (omitted: unchanged, null: none)."""
    changes = body.model_dump(include=body.model_fields_set)
    return _out(ctx, await lifecycle.set_timeouts(ctx, sandbox, changes))


@router.put("/{sandbox_id}/ports")
async def set_ports(body: PortsBody, sandbox: Sandbox, ctx: Context) -> SandboxOut:
    """Who may reach servers listening in the sandbox: nobody, holders of its traffic
    token, or anyone (docs/api.md "Ports"); from the next request on. Idempotent."""
    return _out(ctx, await ports.set_ports(ctx, sandbox, body))


@router.post("/{sandbox_id}/restore")
async def restore_sandbox(
    body: RestoreBody, sandbox: Sandbox, tenant: Tenant, ctx: Context
) -> SandboxOut:
    """Roll the sandbox back to one of the tenant's snapshots on its node."""
    snapshot = await snapshots.find_snapshot(ctx, tenant, body.snapshot_id)
    return _out(ctx, await snapshots.restore_sandbox(ctx, sandbox, snapshot))


@router.post("/{sandbox_id}/fork", status_code=201)
async def fork_sandbox(
    sandbox: Sandbox,
    ctx: Context,
    body: ForkBody | None = None,
    idempotency_key: IdempotencyKey = None,
) -> dict[str, list[SandboxOut]]:
    """``count`` new running copies of the sandbox (the body is optional: one copy);
    idempotent with an ``Idempotency-Key``."""
    count = body.count if body is not None else 1
    idem = idempotency(idempotency_key, sandbox.tenant_id, "fork", sandbox.id, {"count": count})
    children = await snapshots.fork_sandbox(ctx, sandbox, count, idem)
    return {"sandboxes": [_out(ctx, child) for child in children]}
