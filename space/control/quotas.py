"""Per-tenant quotas (issue 17, "one tenant fills the node"): their limits, the refusal,
and the build slots.

``space.limits.QUOTAS`` is the one table of quotas (the CLI reads it too); everything
else (the limits in ``ControlSettings.quotas``, the ``tenant_quotas`` overrides, ``GET
/v1/quota``, ``space quota``) is keyed by its names. What counts:

- ``running_sandboxes``: sandboxes holding a VM (``creating``, ``running``, ``paused``);
- ``suspended_sandboxes``: sandboxes holding only a volume (``hibernated``, ``stopped``);
- ``vcpus``, ``memory_mib``: summed over the running ones;
- ``disk_mib``: summed over every sandbox holding a volume (running and suspended);
- ``snapshots``: snapshots being taken or listed;
- ``templates``: the tenant's own ``name:tag`` pairs on its nodes;
- ``builds``: template builds in flight, from the start of the upload to the end of the
  result stream (counted per control-plane replica).

A sandbox in ``error`` counts nowhere: it holds no VM, and its tenant can delete it.
Refusals are ApiError(resource_exhausted), answered 429, naming the quota, its limit,
the use and the request (``details``: quota, limit, used, requested).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from space.control.errors import ApiError
from space.limits import QUOTAS, Quota

__all__ = [
    "BUILDS",
    "DISK_MIB",
    "MEMORY_MIB",
    "QUOTAS",
    "QUOTA_NAMES",
    "RUNNING_SANDBOXES",
    "SNAPSHOTS",
    "SUSPENDED_SANDBOXES",
    "TEMPLATES",
    "VCPUS",
    "BuildSlot",
    "Quota",
    "QuotaLimits",
    "TenantSlots",
    "check",
    "refusal",
]


(
    RUNNING_SANDBOXES,
    SUSPENDED_SANDBOXES,
    VCPUS,
    MEMORY_MIB,
    DISK_MIB,
    SNAPSHOTS,
    TEMPLATES,
    BUILDS,
) = QUOTAS
QUOTA_NAMES = frozenset(quota.name for quota in QUOTAS)


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    """Every quota's limit, one field per quota name.

    The defaults are the operator's (``ControlSettings.quotas``): generous enough for
    one tenant to fill a large node (bench_fill runs 48 sandboxes as one tenant), small
    enough that one tenant cannot hold a cluster. A tenant's own limits (``space quota
    set``, in the database, so that every replica and ``space quota show`` agree)
    replace single fields.
    """

    running_sandboxes: int = 100
    suspended_sandboxes: int = 200
    vcpus: int = 200
    # 100 default sandboxes (256 MiB) take 25 GiB; room for larger ones.
    memory_mib: int = 256 * 1024
    # 300 default sandboxes' disks (2 GiB each), running and suspended.
    disk_mib: int = 600 * 1024
    snapshots: int = 500
    templates: int = 50
    builds: int = 2

    def __post_init__(self) -> None:
        for quota in QUOTAS:
            value = self.of(quota)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"quota {quota.name} must be a whole number >= 0, not {value!r}")

    def of(self, quota: Quota) -> int:
        """The limit of ``quota``."""
        value: int = getattr(self, quota.name)
        return value

    def with_overrides(self, overrides: Mapping[str, int]) -> QuotaLimits:
        """These limits with ``overrides`` (quota name → limit) in place of the defaults."""
        return replace(self, **{k: v for k, v in overrides.items() if k in QUOTA_NAMES})


# Kept identical to QUOTAS by construction: a new quota is a new field or a TypeError here.
assert {f.name for f in fields(QuotaLimits)} == QUOTA_NAMES


def refusal(quota: Quota, limit: int, used: int, requested: int, operation: str) -> ApiError:
    """The 429 of a request that would take ``used + requested`` past ``limit``."""
    return ApiError(
        "resource_exhausted",
        f"quota {quota.name}: {used} of {limit} {quota.unit} in use,"
        f" this {operation} needs {requested}",
        quota=quota.name,
        limit=limit,
        used=used,
        requested=requested,
    )


def check(
    limits: QuotaLimits,
    used: Mapping[str, int],
    requested: Mapping[str, int],
    operation: str,
) -> None:
    """Raise the refusal of the first quota (in QUOTAS order) that ``requested`` would
    take past its limit, given ``used`` (both quota name → amount; ``used`` excludes the
    request). A quota asked for nothing is never refused, even if already over."""
    for quota in QUOTAS:
        asked = requested.get(quota.name, 0)
        if asked > 0 and used.get(quota.name, 0) + asked > limits.of(quota):
            raise refusal(quota, limits.of(quota), used.get(quota.name, 0), asked, operation)


class BuildSlot:
    """One build slot of a tenant, held until ``release`` (idempotent)."""

    def __init__(self, slots: TenantSlots, tenant: str) -> None:
        self._slots = slots
        self._tenant = tenant
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots._release(self._tenant)


class TenantSlots:
    """Per tenant, in this replica: template builds in flight, and the lock that wakes,
    hibernations and creates take (so that no two of one tenant pass the same count).

    Builds are counted in memory: a build holds its upload and its nodes' build streams,
    all in this replica, and a replica that dies takes its builds with it, so there is
    nothing for a database row to outlive. With several replicas a tenant may run
    ``builds`` builds through each.
    """

    def __init__(self) -> None:
        self._builds: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def builds(self, tenant: str) -> int:
        """The tenant's builds in flight in this replica."""
        return self._builds.get(tenant, 0)

    def take_build(self, tenant: str, limit: int) -> BuildSlot:
        """A build slot of ``tenant``; ApiError(resource_exhausted) if ``limit`` builds
        are in flight already (nothing is taken then)."""
        used = self.builds(tenant)
        if used + 1 > limit:
            raise refusal(BUILDS, limit, used, 1, "build")
        self._builds[tenant] = used + 1
        return BuildSlot(self, tenant)

    def _release(self, tenant: str) -> None:
        left = self._builds.get(tenant, 0) - 1
        if left > 0:
            self._builds[tenant] = left
        else:
            self._builds.pop(tenant, None)

    def move_lock(self, tenant: str) -> asyncio.Lock:
        """The tenant's lock for moving sandboxes between running and suspended (made
        on first use)."""
        return self._locks.setdefault(tenant, asyncio.Lock())
