"""``/v1/secrets``: the tenant's secrets, by name (issue 5).

Tenant-scoped: another tenant's secret is exactly a missing one (404). Answers carry
metadata only; a value goes in (``PUT``) and never comes out, in no answer or error.
"""

from __future__ import annotations

from fastapi import APIRouter, Response

from space.control import broker
from space.control.deps import Context, Tenant
from space.control.errors import ApiError
from space.control.schemas import SecretOut, SecretPut
from space.control.store import secrets as stored

__all__ = ["router"]

router = APIRouter(prefix="/v1/secrets", tags=["secrets"])


@router.put("/{name}")
async def put_secret(name: str, body: SecretPut, tenant: Tenant, ctx: Context) -> SecretOut:
    """Create or replace (idempotent); bound sandboxes get the new value at once."""
    return SecretOut.of(await broker.put_secret(ctx, tenant, name, body))


@router.get("")
async def list_secrets(tenant: Tenant, ctx: Context) -> dict[str, list[SecretOut]]:
    """The tenant's secrets by name, metadata only."""
    records = await ctx.db.run(lambda s: stored.list_secrets(s, tenant))
    return {"secrets": [SecretOut.of(record) for record in records]}


@router.get("/{name}")
async def get_secret(name: str, tenant: Tenant, ctx: Context) -> SecretOut:
    record = await ctx.db.run(lambda s: stored.find_secret(s, tenant, name))
    if record is None:
        raise ApiError("not_found", f"no secret {name!r}", name=name)
    return SecretOut.of(record)


@router.delete("/{name}", status_code=204)
async def delete_secret(name: str, tenant: Tenant, ctx: Context) -> Response:
    """Idempotent: a missing secret answers 204 too. Bound sandboxes lose it at once."""
    await broker.delete_secret(ctx, tenant, name)
    return Response(status_code=204)
