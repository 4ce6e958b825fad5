"""``/v1/quota``: the caller's tenant's limits and what it uses of each (issue 17)."""

from __future__ import annotations

from fastapi import APIRouter

from space.control import quota_checks
from space.control.deps import Context, Tenant
from space.control.schemas import QuotaOut

__all__ = ["router"]

router = APIRouter(prefix="/v1/quota", tags=["quota"])


@router.get("")
async def get_quota(tenant: Tenant, ctx: Context) -> dict[str, dict[str, QuotaOut]]:
    """Every quota by name (space.control.quotas.QUOTAS order): ``limit``, ``used``,
    ``unit``. Read-only; the limits are changed by the operator (``space quota set``)."""
    report = await quota_checks.quota_report(ctx, tenant)
    return {"quotas": {name: QuotaOut(**use) for name, use in report.items()}}
