"""``SandboxMetric``: one sample of a sandbox's CPU, memory and disk, and the call that
reads them (``AsyncSandbox.get_metrics``; docs/api.md, "Metrics")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from space.sdk._http import ApiClient, json_object, listed
from space.sdk._models import _required_int, _required_time
from space.sdk._sandbox_requests import segment
from space.sdk.errors import InternalError

__all__ = ["SandboxMetric", "get_metrics"]


@dataclass(frozen=True, slots=True)
class SandboxMetric:
    """One sample, as E2B's ``SandboxMetric``: when the node took it, the vCPUs and the
    share of them busy since the sample before (0 to 100), memory and root disk used
    and total in bytes (memory used is total minus what the kernel could still hand
    out: page cache does not count)."""

    timestamp: datetime
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    disk_used: int
    disk_total: int

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> SandboxMetric:
        """Parse a SandboxMetric object; raises InternalError if it is malformed."""
        try:
            pct = body["cpu_used_pct"]
            if not isinstance(pct, int | float) or isinstance(pct, bool) or not 0 <= pct <= 100:
                raise TypeError(f"cpu_used_pct is not a number from 0 to 100: {pct!r}")
            return cls(
                timestamp=_required_time(body, "timestamp"),
                cpu_count=_required_int(body, "cpu_count"),
                cpu_used_pct=float(pct),
                mem_used=_required_int(body, "mem_used"),
                mem_total=_required_int(body, "mem_total"),
                disk_used=_required_int(body, "disk_used"),
                disk_total=_required_int(body, "disk_total"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InternalError(f"malformed metric in answer: {exc!r}") from None


async def get_metrics(
    api: ApiClient,
    sandbox_id: str,
    start: datetime | float | None,
    end: datetime | float | None,
) -> list[SandboxMetric]:
    """The samples of ``GET /v1/sandboxes/{id}/metrics`` between ``start`` and ``end``."""
    params = {
        name: str(int(value.timestamp() if isinstance(value, datetime) else value))
        for name, value in (("start", start), ("end", end))
        if value is not None
    }
    body = await api.request_json(
        "GET",
        f"/v1/sandboxes/{segment(sandbox_id, 'sandbox id')}/metrics",
        operation="sandbox.get_metrics",
        sandbox_id=sandbox_id,
        params=params,
    )
    items = listed(body, "metrics", "sandbox.get_metrics")
    return [SandboxMetric.from_wire(json_object(item)) for item in items]
