"""The node's admission: every VM start asks it first (issue 15).

Private to space.node.agent. ``Admission.claim`` measures the host, decides with
space.node.core.capacity (the formula is there) and, if there is room, holds the claim
as a start in flight until its block ends, when the VM's memory shows in MemAvailable
and its sandbox in the registry. Deciding and holding happen without an await in
between, so two concurrent starts cannot both take the last room.

Who claims: creates, fork children and moves' imports (``Claim.sandbox``; an import
holds its claim while its stream comes), wakes from hibernation and
restores of a hibernated sandbox (``Claim.wake``), warm-pool refills and the VMs of
template builds and ready states (``Claim.node_vm``). A build or ready-state VM is also
held as one of the node's own running VMs from its boot until ``release`` (the
registry's ``destroy``); a warm-pool VM, once paused, is not (it cannot grow, and its
hand-over is a create, admitted as one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

from space.node.api import CapacityInfo
from space.node.core.capacity import (
    Claim,
    Host,
    Load,
    Policy,
    Resident,
    capacity_info,
    shortage,
)

__all__ = ["Admission"]


class Admission:
    """Decides whether the node has room for more VMs and holds what starts in flight.

    ``residents`` lists the node's tenant sandboxes by id (the registry's); ``measure``
    reads the host (space.node.core.capacity.measure_host; tests pass figures).
    """

    def __init__(
        self,
        policy: Policy,
        *,
        residents: Callable[[], Mapping[str, Resident]],
        measure: Callable[[], Host],
    ) -> None:
        self.policy = policy
        self._residents = residents
        self._measure = measure
        self._starting: dict[str, Claim] = {}
        self._node_vms: dict[str, int] = {}

    @contextlib.contextmanager
    def claim(
        self, claims: Mapping[str, Claim], *, sandbox_id: str | None = None
    ) -> Iterator[None]:
        """Admit ``claims`` (VMs about to start, by id) and hold them for the block.

        Raises InsufficientCapacity (carrying ``sandbox_id``) and holds nothing if the
        node has no room; Unavailable if the host cannot be measured. No claims: no
        check. The claims are released however the block ends, cancellation included.
        """
        if claims:
            refusal = shortage(
                self.policy, self._measure(), self._load(), claims, sandbox_id=sandbox_id
            )
            if refusal is not None:
                raise refusal
        self._starting.update(claims)
        try:
            yield
        finally:
            for vm_id in claims:
                self._starting.pop(vm_id, None)

    def hold(self, vm_id: str, memory_mib: int) -> None:
        """Count one of the node's own VMs (a build or ready-state VM) as running."""
        self._node_vms[vm_id] = memory_mib

    def release(self, vm_id: str) -> None:
        """Forget the node's own VM ``vm_id`` (gone); nothing if it was never held."""
        self._node_vms.pop(vm_id, None)

    def info(self) -> CapacityInfo:
        """The figures admission decides from now (Unavailable if unmeasurable)."""
        return capacity_info(self.policy, self._measure(), self._load())

    def _load(self) -> Load:
        return Load(
            sandboxes=self._residents(),
            node_vms=dict(self._node_vms),
            starting=dict(self._starting),
        )
