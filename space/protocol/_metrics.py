"""The ``system.metrics`` answer: one sample of the guest's CPU, memory and disk.

Both ends use ``Metrics``: spaced builds its RESULT from one, the host decodes the
guest's RESULT through ``Metrics.from_result``, which refuses anything a guest could
use to mislead the host or its dashboards: wrong types, floats for byte counts, a
CPU share outside 0 to 100 %, counts past the bounds below, used above total.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from ._frames import ProtocolError

__all__ = ["MAX_METRICS_BYTES", "MAX_METRICS_CPUS", "METRICS_FIELDS", "Metrics"]

#: Most vCPUs a guest may report: QEMU's x86 ``-smp`` maximum (1,024 on q35 with x2APIC).
MAX_METRICS_CPUS = 1024
#: Largest memory or disk size a guest may report, in bytes: 1 PiB, far above any
#: sandbox of a node (whose RAM and btrfs pool bound them), far below where JSON
#: numbers stop being exact (2**53).
MAX_METRICS_BYTES = 2**50


@dataclass(frozen=True, slots=True)
class Metrics:
    """One sample, as spaced measured it; construction validates every field.

    ``cpu_used_pct`` is the share of all vCPUs busy since the guest's previous sample
    (0 to 100); memory used is MemTotal - MemAvailable; disk is the root filesystem's
    (statvfs: blocks minus free blocks). Sizes in bytes. Raises ProtocolError.
    """

    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    disk_used: int
    disk_total: int

    def __post_init__(self) -> None:
        _check_count("cpu_count", self.cpu_count, 1, MAX_METRICS_CPUS)
        pct = self.cpu_used_pct
        if isinstance(pct, bool) or not isinstance(pct, int | float) or not math.isfinite(pct):
            raise ProtocolError("cpu_used_pct must be a finite number")
        if not 0 <= pct <= 100:
            raise ProtocolError(f"cpu_used_pct {pct} is outside 0 to 100")
        for used, total in (("mem_used", "mem_total"), ("disk_used", "disk_total")):
            _check_count(total, getattr(self, total), 1, MAX_METRICS_BYTES)
            _check_count(used, getattr(self, used), 0, getattr(self, total))

    def to_result(self) -> dict[str, object]:
        """The RESULT payload: ``{"ok": true, <METRICS_FIELDS>}``."""
        return {"ok": True} | {name: getattr(self, name) for name in METRICS_FIELDS}

    @classmethod
    def from_result(cls, message: Mapping[str, object]) -> Metrics:
        """Decode the guest's RESULT strictly (extra fields are ignored, for later
        versions of spaced); raises ProtocolError."""
        values = {name: message.get(name) for name in METRICS_FIELDS}
        pct = values["cpu_used_pct"]
        if isinstance(pct, int) and not isinstance(pct, bool):
            values["cpu_used_pct"] = float(pct)
        return cls(**values)  # type: ignore[arg-type]  # __post_init__ checks each type


#: The fields of a sample, in wire order.
METRICS_FIELDS = tuple(f.name for f in fields(Metrics))


def _check_count(name: str, value: object, low: int, high: int) -> None:
    # bool is an int subclass, and a float (1e300) is no byte count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name} must be an integer")
    if not low <= value <= high:
        raise ProtocolError(f"{name} {value} is outside {low} to {high}")
