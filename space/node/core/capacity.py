"""Admission by capacity: whether a node has room for more VMs now (issues 15, 17).

Pure: figures in, a decision out. ``measure_host`` (/proc/meminfo and the pool's
statvfs) is the only I/O; the node agent's ``Admission`` (space.node.agent._admission)
asks ``shortage`` before every VM it starts: a create, each child of a fork, a wake
from hibernation (also a restore of a hibernated sandbox), a warm-pool refill, and the
VM of a template build or ready state; and before a move's import (issue 19), which
admits the hibernated sandbox it pulls in as a create of its size, so that it can be
woken where it lands.

What a VM costs. An idle default sandbox (256 MiB) took about 56 MiB of host memory
(MemAvailable, docs/benchmarks.md), but a guest may grow towards all its ``memory_mib``,
and QEMU adds its own beyond guest RAM: up to ``VM_OVERHEAD_MIB``. Hibernating (or a
snapshot, a fork) writes up to ``memory_mib`` of saved RAM into the VM's volume; its disk
is a CoW clone that grows as the guest writes, up to ``disk_mib``. A btrfs quota group
bounds what each volume may reference to ``volume_limit_mib``: disk + memory + a margin
(space.node.storage.btrfs; the guest's ext4 is sized to its disk, so a guest that fills
it gets ENOSPC from its own filesystem, and no volume can take more of the pool than its
limit). Disks are not reserved (thin provisioning: a 20 GiB pool could not hold a
hundred 2 GiB disks written full, nor would any of them ever be); each new volume's
whole limit must fit beside the reserve and the room kept to save the RAM of every VM
that holds memory, so no one disk can fill the pool or take that room. Many disks
written full together still can: their guests' writes then fail, saves may fail too,
and no VM stops (QEMU reports the failed write to its guest, space.node.vmm.qemu;
tests/integration/test_full_disk.py fills a pool so).

The decision, for new VMs N (one for a create or wake, n for a fork), with M = MemTotal,
A = MemAvailable, R = memory reserve, o = overcommit ratio, F = the pool's free space,
P = pool reserve, S = starts in flight (admitted, not yet running):

1. sandboxes:        count + |N as sandboxes| <= max_sandboxes, if the operator set a cap.
2. committed memory: sum(charge(v) for v in growable + N) <= o * (M - R),
   charge(v) = memory_mib + VM_OVERHEAD_MIB. Growable: tenant sandboxes creating,
   running or paused (a paused one resumes at any time), the starts in flight and the
   node's own running VMs. A hibernated sandbox holds no memory (nor an errored one,
   whose VM is gone); a warm-pool VM waiting paused cannot grow, and becomes a sandbox
   only through a create, which is admitted as one.
3. memory:           A - sum(start(s) for s in S + N) >= R,
   start(s) = VM_OVERHEAD_MIB + memory_mib / 4: what a VM may take before MemAvailable
   shows it (about three times the 56 MiB measured), reserved for each start in flight,
   so concurrent creates cannot all spend the same free memory.
4. pool:             F - P - sum(memory_mib(v) for v in holding - N) >= sum(pool(n) for n in N),
   pool(n) = volume_limit_mib(disk_mib, memory_mib) for a new VM, 0 for a wake (its
   volume is in the pool already). Holding: the VMs that hold memory as in guard 2
   (creating, running or paused sandboxes, the node's own running VMs, every start in
   flight, wakes too): each keeps room to save its RAM once. A hibernated sandbox's
   saved RAM is in the pool already, counted in F. A pool already below its reserve
   admits nothing.

The first guard that fails is the refusal: InsufficientCapacity (HTTP 503, code
``capacity``) naming the resource, what was needed and what was available. Guard 2
bounds what the admitted VMs can grow to; guard 3 is the live check, which stops
admission before the host would swap or OOM even if the guests already use more than
expected; guard 4 keeps btrfs (which fails badly when full) and hibernation working:
the probe of issue 17, a 16 GiB disk on a pool with 2.2 GiB free, is refused.
What a guest dirties is its VM's anonymous memory (guest RAM is anonymous or a private
mapping of a ready state's RAM file), so MemAvailable shows it; the ready state's clean
pages, shared by all its sandboxes, are page cache it counts as reclaimable.

Defaults (space/limits.py). R = a tenth of MemTotal within 1-8 GiB: the node agent,
control plane, egress gateway and the page cache of the pool's images live there. o =
2.0: on a 24 GiB host (R = 2.4 GiB) guard 2 admits 123 default sandboxes (352 MiB charged
each) where the machine then held about 7 GiB of them (56 MiB each); the host stays out
of OOM as long as the guests use on average less than half of what they may, and guard
3 refuses new VMs once they use more. Idle-timeout hibernation frees memory. P = a tenth
of the pool within 1-32 GiB. On that host's default 20 GiB pool guard 4 binds first:
the base template and its ready state take 805 MiB of a fresh pool (measured), leaving
19675 MiB free, so it admits 1 + (19675 - P 2048 - 2560) / (256 + u) idle default
sandboxes, u being what each one's volume takes of the pool: 48 for u = 60 MiB, 58 for
u = 5 MiB; with a 48 GiB pool memory binds again (125). That is the price of room to
save every running VM's RAM whatever happens to the pool: size the pool to the
sandboxes memory admits (for default ones, twice the host memory).

The volume margin (``VOLUME_MARGIN_MIB`` + disk/16) is a judgement, not a proof: btrfs
keeps an extent whole while any part of it is referenced ("bookends"), so a guest that
rewrites parts of large extents can reference more than its disk's size, and an
adversarial one up to about twice. It then gets I/O errors from its volume's limit
rather than ENOSPC from its ext4, and its own hibernation may fail for lack of room
(btrfs refuses even a truncate in a volume at its limit), while the pool and every
other VM stay unharmed. Measured (docs/benchmarks.md, "Issue 17: disk quotas and a full
disk"): a guest writing zeros until its 1 GiB ext4 is full references 976 of its 1472
MiB and still hibernates; the quotas cost tens of milliseconds per snapshot and per
subvolume dropped.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from space.limits import (
    DEFAULT_DISK_MIB,
    DEFAULT_MEMORY_MIB,
    DEFAULT_MEMORY_OVERCOMMIT,
    MEMORY_RESERVE_MIB,
    MEMORY_RESERVE_SHARE,
    POOL_RESERVE_MIB,
    POOL_RESERVE_SHARE,
)
from space.node.api import CapacityInfo, InsufficientCapacity, SandboxState, Unavailable

__all__ = [
    "VM_OVERHEAD_MIB",
    "Claim",
    "Host",
    "Load",
    "Policy",
    "Resident",
    "capacity_info",
    "holds_memory",
    "measure_host",
    "shortage",
    "volume_limit_mib",
]

#: Host memory a VM may take beyond its guest RAM: TCG's translation cache (64 MiB,
#: space/node/vmm/qemu.py's tb-size) plus QEMU's own heap and device buffers (an
#: estimate: 132 MiB RSS measured for an idle 256 MiB sandbox woken from a ready state,
#: its guest pages and the ready state's shared ones included; docs/benchmarks.md).
VM_OVERHEAD_MIB = 96
_MIB = 1024 * 1024
#: Sandbox states whose VM holds (or is about to hold) host memory.
_MEMORY_STATES = frozenset({SandboxState.CREATING, SandboxState.RUNNING, SandboxState.PAUSED})


#: What a sandbox volume may reference beyond its disk and one saved RAM: kernel and
#: initrd (17 MiB for the base template), a save's device state (a few MiB), a state
#: file rewritten before btrfs has freed the old one, and "bookend" extents: an extent
#: partly overwritten stays whole on disk while any of it is referenced, so a disk
#: image's extents may reference more than its size (the module docstring's last part).
VOLUME_MARGIN_MIB = 128
#: ... plus this share of the disk for bookends, which grow with what the guest writes.
VOLUME_MARGIN_DISK_SHARE = 1 / 16


def volume_limit_mib(disk_mib: int, memory_mib: int) -> int:
    """The most a VM's volume may reference: its btrfs quota group's limit and the room
    guard 4 asks for a new volume. Its disk, room to save its RAM, and the margin."""
    margin = VOLUME_MARGIN_MIB + int(disk_mib * VOLUME_MARGIN_DISK_SHARE)
    return disk_mib + memory_mib + margin


def holds_memory(state: SandboxState) -> bool:
    """Whether a sandbox in ``state`` has a VM that holds host memory and may grow."""
    return state in _MEMORY_STATES


@dataclass(frozen=True, slots=True)
class Policy:
    """The operator's settings (space.node.core.config.NodeConfig); None: the default."""

    memory_reserve_mib: int | None = None
    memory_overcommit: float = DEFAULT_MEMORY_OVERCOMMIT
    pool_reserve_mib: int | None = None
    max_sandboxes: int | None = None

    def memory_reserve(self, host: Host) -> int:
        if self.memory_reserve_mib is not None:
            return self.memory_reserve_mib
        return MEMORY_RESERVE_MIB.clamp(int(host.memory_total_mib * MEMORY_RESERVE_SHARE))

    def pool_reserve(self, host: Host) -> int:
        if self.pool_reserve_mib is not None:
            return self.pool_reserve_mib
        return POOL_RESERVE_MIB.clamp(int(host.pool_total_mib * POOL_RESERVE_SHARE))

    def commit_limit(self, host: Host) -> int:
        return int(self.memory_overcommit * (host.memory_total_mib - self.memory_reserve(host)))


@dataclass(frozen=True, slots=True)
class Host:
    """The host as measured now, in MiB."""

    memory_total_mib: int
    memory_available_mib: int
    pool_total_mib: int
    pool_free_mib: int


@dataclass(frozen=True, slots=True)
class Claim:
    """What starting one VM asks of the node: its guest RAM, the pool room its new
    volume needs (guard 4's need; 0 for a volume the pool holds already) and whether it
    is one more tenant sandbox (counted against the cap)."""

    memory_mib: int
    pool_mib: int
    sandboxes: int

    @classmethod
    def sandbox(cls, memory_mib: int, disk_mib: int) -> Claim:
        """A new sandbox: a create, a fork child, or one a move brings in."""
        return cls(memory_mib, volume_limit_mib(disk_mib, memory_mib), 1)

    @classmethod
    def wake(cls, memory_mib: int) -> Claim:
        """A sandbox's VM started again from the volume it has in the pool."""
        return cls(memory_mib, 0, 0)

    @classmethod
    def node_vm(cls, memory_mib: int, disk_mib: int) -> Claim:
        """One of the node's own VMs: a warm-pool VM, a build or ready-state VM."""
        return cls(memory_mib, volume_limit_mib(disk_mib, memory_mib), 0)

    @property
    def charge_mib(self) -> int:
        """What the VM may grow to: guard 2's measure."""
        return self.memory_mib + VM_OVERHEAD_MIB

    @property
    def start_mib(self) -> int:
        """What the VM may take before MemAvailable shows it: guard 3's measure."""
        return VM_OVERHEAD_MIB + self.memory_mib // 4


class Resident(NamedTuple):
    """A tenant sandbox the node has: its state and guest RAM."""

    state: SandboxState
    memory_mib: int


@dataclass(frozen=True, slots=True)
class Load:
    """What the node holds, by id: its tenant sandboxes, its own running VMs (builds,
    ready states: their guest RAM) and the starts in flight."""

    sandboxes: Mapping[str, Resident]
    node_vms: Mapping[str, int]
    starting: Mapping[str, Claim]

    def committed_mib(self) -> int:
        """Guard 2's sum over what may grow now (each id once)."""
        growable = {sid: r.memory_mib for sid, r in self.sandboxes.items() if holds_memory(r.state)}
        growable |= self.node_vms
        growable |= {sid: claim.memory_mib for sid, claim in self.starting.items()}
        return sum(mib + VM_OVERHEAD_MIB for mib in growable.values())

    def sandbox_count(self) -> int:
        new = {sid for sid, claim in self.starting.items() if claim.sandboxes}
        return len(self.sandboxes.keys() | new)

    def starting_mib(self) -> int:
        return sum(claim.start_mib for claim in self.starting.values())

    def kept_pool_mib(self, new: Mapping[str, Claim] | None = None) -> int:
        """Guard 4's room kept to save the RAM of every VM holding memory (each id once),
        those in ``new`` left out: their claim asks for their whole volume."""
        holding = {sid: r.memory_mib for sid, r in self.sandboxes.items() if holds_memory(r.state)}
        holding |= self.node_vms
        holding |= {sid: claim.memory_mib for sid, claim in self.starting.items()}
        return sum(mib for sid, mib in holding.items() if sid not in (new or {}))


class _Guard(NamedTuple):
    resource: str
    needed: int
    available: int
    unit: str
    why: str
    #: What each further VM like ``new`` would need once ``new`` is admitted: the same
    #: but for the pool, where an admitted VM keeps only its RAM's room.
    next_needed: int | None = None

    def room(self) -> int:
        """How many VMs like ``new`` this guard would admit one after another."""
        if self.available < self.needed:
            return 0
        step = max(self.needed if self.next_needed is None else self.next_needed, 1)
        return 1 + (self.available - self.needed) // step


def _guards(policy: Policy, host: Host, load: Load, new: Mapping[str, Claim]) -> list[_Guard]:
    """Each guard's need and availability for ``new``, in the order refusals name them."""
    reserve, pool_reserve = policy.memory_reserve(host), policy.pool_reserve(host)
    starting, kept = load.starting_mib(), load.kept_pool_mib(new)
    committed, limit = load.committed_mib(), policy.commit_limit(host)
    held = f"by {len(load.starting)} VM{'s' if len(load.starting) != 1 else ''} starting"
    guards = []
    if policy.max_sandboxes is not None:
        count = load.sandbox_count()
        guards.append(
            _Guard(
                "sandboxes",
                sum(claim.sandboxes for claim in new.values()),
                policy.max_sandboxes - count,
                "sandboxes",
                f"the node has {count} of at most {policy.max_sandboxes}",
            )
        )
    guards += [
        _Guard(
            "committed_memory",
            sum(claim.charge_mib for claim in new.values()),
            limit - committed,
            "MiB",
            f"live VMs may grow to {committed} MiB of the {limit} MiB limit,"
            f" {policy.memory_overcommit:g} x (memory {host.memory_total_mib} MiB"
            f" - reserve {reserve} MiB)",
        ),
        _Guard(
            "memory",
            sum(claim.start_mib for claim in new.values()),
            host.memory_available_mib - starting - reserve,
            "MiB",
            f"{host.memory_available_mib} MiB available less the {reserve} MiB reserve"
            f" and {starting} MiB held {held}",
        ),
        _Guard(
            "pool",
            sum(claim.pool_mib for claim in new.values()),
            host.pool_free_mib - kept - pool_reserve,
            "MiB",
            f"{host.pool_free_mib} MiB free in the pool less the {pool_reserve} MiB"
            f" reserve and {kept} MiB kept to save the RAM of the VMs holding memory",
            sum(claim.memory_mib for claim in new.values()),
        ),
    ]
    return guards


def shortage(
    policy: Policy,
    host: Host,
    load: Load,
    new: Mapping[str, Claim],
    *,
    sandbox_id: str | None = None,
) -> InsufficientCapacity | None:
    """The refusal of ``new`` (VMs about to start, by id), or None if the node has room.

    The error names the first guard that fails (see the module docstring), carrying
    ``sandbox_id``; raising it is the caller's. Pure.
    """
    for guard in _guards(policy, host, load, new):
        if guard.needed > guard.available:
            unit = guard.unit
            return InsufficientCapacity(
                f"node has no room for {len(new)} more VM{'s' if len(new) != 1 else ''}:"
                f" {guard.resource} is short by {guard.needed - guard.available} {unit}"
                f" (needs {guard.needed} {unit}, {guard.available} {unit} left: {guard.why});"
                " retry later",
                sandbox_id=sandbox_id,
                resource=guard.resource,
                needed=guard.needed,
                available=guard.available,
                unit=unit,
            )
    return None


def capacity_info(policy: Policy, host: Host, load: Load) -> CapacityInfo:
    """The figures the guards decide from, and how many more default sandboxes fit."""
    one = Claim.sandbox(DEFAULT_MEMORY_MIB, DEFAULT_DISK_MIB)
    room = min(guard.room() for guard in _guards(policy, host, load, {"": one}))
    return CapacityInfo(
        memory_total_mib=host.memory_total_mib,
        memory_available_mib=host.memory_available_mib,
        memory_starting_mib=load.starting_mib(),
        memory_reserve_mib=policy.memory_reserve(host),
        memory_committed_mib=load.committed_mib(),
        memory_commit_limit_mib=policy.commit_limit(host),
        pool_total_mib=host.pool_total_mib,
        pool_free_mib=host.pool_free_mib,
        pool_kept_mib=load.kept_pool_mib(),
        pool_reserve_mib=policy.pool_reserve(host),
        starting=len(load.starting),
        max_sandboxes=policy.max_sandboxes,
        room=max(room, 0),
    )


def measure_host(pool: Path, meminfo: Path = Path("/proc/meminfo")) -> Host:
    """Memory from ``meminfo`` and the pool's size and free space (statvfs), in MiB.

    Raises Unavailable if either cannot be read. Takes well under a millisecond.
    """
    try:
        fields = _meminfo_kib(meminfo.read_text())
        stat = os.statvfs(pool)
        total_kib, available_kib = fields["MemTotal"], fields["MemAvailable"]
    except (OSError, KeyError, ValueError) as exc:
        raise Unavailable(f"cannot measure the node's capacity: {exc!r}") from exc
    return Host(
        memory_total_mib=total_kib // 1024,
        memory_available_mib=available_kib // 1024,
        pool_total_mib=stat.f_blocks * stat.f_frsize // _MIB,
        pool_free_mib=stat.f_bavail * stat.f_frsize // _MIB,
    )


def _meminfo_kib(text: str) -> dict[str, int]:
    """``Name: 123 kB`` lines of /proc/meminfo as {name: KiB}."""
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name.strip()] = int(parts[0])
    return fields
