"""The capacity model decides admission from synthetic host figures (issue 15)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from space.limits import DEFAULT_DISK_MIB, DEFAULT_MEMORY_MIB
from space.node.api import InsufficientCapacity, SandboxState, Unavailable
from space.node.core.capacity import (
    VM_OVERHEAD_MIB,
    Claim,
    Host,
    Load,
    Policy,
    Resident,
    capacity_info,
    measure_host,
    shortage,
    volume_limit_mib,
)

GIB = 1024
#: The machine of docs/benchmarks.md: 24 GiB, a 20 GiB loop pool, nothing running yet.
HOST = Host(
    memory_total_mib=24 * GIB,
    memory_available_mib=23 * GIB,
    pool_total_mib=20 * GIB,
    pool_free_mib=18 * GIB,
)
#: The same host with a pool large enough that memory alone decides.
ROOMY = replace(HOST, pool_total_mib=64 * GIB, pool_free_mib=62 * GIB)
#: What one idle default sandbox took there (MemAvailable), and a guess for the pool.
IDLE_MIB, POOL_PER_SANDBOX_MIB = 56, 60
DEFAULT = Claim.sandbox(DEFAULT_MEMORY_MIB, DEFAULT_DISK_MIB)
#: What a default sandbox's volume may reference: 2048 + 256 + 128 + 2048 / 16.
VOLUME = 2560
CHARGE = DEFAULT_MEMORY_MIB + VM_OVERHEAD_MIB  # 352
START = VM_OVERHEAD_MIB + DEFAULT_MEMORY_MIB // 4  # 160
RUNNING, HIBERNATED = SandboxState.RUNNING, SandboxState.HIBERNATED


def _load(
    sandboxes: dict[str, Resident] | None = None,
    *,
    node_vms: dict[str, int] | None = None,
    starting: dict[str, Claim] | None = None,
) -> Load:
    return Load(sandboxes or {}, node_vms or {}, starting or {})


def _running(n: int, state: SandboxState = RUNNING) -> dict[str, Resident]:
    return {f"sb-{i}": Resident(state, DEFAULT_MEMORY_MIB) for i in range(n)}


def _fill(policy: Policy, host: Host) -> tuple[int, InsufficientCapacity]:
    """Admit idle default sandboxes one at a time, each taking what the bench measured,
    until the first refusal; the count admitted and that refusal."""
    sandboxes: dict[str, Resident] = {}
    while True:
        refusal = shortage(policy, host, _load(sandboxes), {"next": DEFAULT})
        if refusal is not None:
            return len(sandboxes), refusal
        sandboxes[f"sb-{len(sandboxes)}"] = Resident(RUNNING, DEFAULT_MEMORY_MIB)
        host = replace(
            host,
            memory_available_mib=host.memory_available_mib - IDLE_MIB,
            pool_free_mib=host.pool_free_mib - POOL_PER_SANDBOX_MIB,
        )


def test_a_24_gib_host_with_a_roomy_pool_admits_over_a_hundred_idle_default_sandboxes() -> None:
    admitted, refusal = _fill(Policy(), ROOMY)
    # Reserve 2457 MiB (a tenth); limit 2.0 x (24576 - 2457) = 44238 MiB; 352 MiB each.
    assert admitted == 125 >= 100
    assert refusal.resource == "committed_memory"
    assert (refusal.needed, refusal.available, refusal.unit) == (
        CHARGE,
        44238 - 125 * CHARGE,
        "MiB",
    )
    assert refusal.code == "capacity" and refusal.sandbox_id is None


def test_on_a_20_gib_pool_disk_not_memory_bounds_idle_default_sandboxes() -> None:
    # Each admitted sandbox keeps 256 MiB to save its RAM, each new one asks for its
    # whole volume: 18432 - 60 n - 2048 reserve - 256 n >= 2560 holds up to n = 43.
    admitted, refusal = _fill(Policy(), HOST)
    assert admitted == 44 >= 24
    assert refusal.resource == "pool"
    assert (refusal.needed, refusal.available) == (VOLUME, 16384 - 316 * 44)
    assert "11264 MiB kept to save the RAM" in refusal.message


def test_a_volume_may_reference_its_disk_its_ram_and_a_margin_that_grows_with_the_disk() -> None:
    assert volume_limit_mib(DEFAULT_DISK_MIB, DEFAULT_MEMORY_MIB) == VOLUME
    assert volume_limit_mib(16384, 256) == 16384 + 256 + 128 + 1024
    assert DEFAULT.pool_mib == VOLUME and Claim.wake(DEFAULT_MEMORY_MIB).pool_mib == 0
    assert Claim.node_vm(1024, 4096).pool_mib == volume_limit_mib(4096, 1024)


def test_negative_the_probes_16_gib_disk_on_2_2_gib_free_is_refused_as_no_pool_room() -> None:
    probe = replace(HOST, pool_free_mib=2253)  # 2.2 GiB
    b_running = _load({"b": Resident(RUNNING, DEFAULT_MEMORY_MIB)})
    refusal = shortage(Policy(), probe, b_running, {"a": Claim.sandbox(256, 16384)}, sandbox_id="a")
    assert refusal is not None and refusal.code == "capacity" and refusal.resource == "pool"
    assert (refusal.needed, refusal.available) == (volume_limit_mib(16384, 256), 2253 - 2048 - 256)
    assert refusal.sandbox_id == "a"


def test_negative_a_disk_fits_exactly_to_the_mib_and_one_more_is_refused() -> None:
    policy = Policy(pool_reserve_mib=1000)
    load = _load({"b": Resident(RUNNING, 512), "c": Resident(HIBERNATED, 4096)})
    need = volume_limit_mib(8192, 256)
    exact = replace(HOST, pool_free_mib=1000 + 512 + need)
    assert shortage(policy, exact, load, {"a": Claim.sandbox(256, 8192)}) is None
    short = replace(exact, pool_free_mib=exact.pool_free_mib - 1)
    refusal = shortage(policy, short, load, {"a": Claim.sandbox(256, 8192)})
    assert refusal is not None and refusal.resource == "pool"
    assert (refusal.needed, refusal.available) == (need, need - 1)


def test_every_vm_holding_memory_keeps_room_to_save_it_and_a_hibernated_one_none() -> None:
    load = _load(
        {
            "running": Resident(RUNNING, 256),
            "paused": Resident(SandboxState.PAUSED, 512),
            "creating": Resident(SandboxState.CREATING, 1024),
            "hibernated": Resident(HIBERNATED, 2048),
            "error": Resident(SandboxState.ERROR, 4096),
        },
        node_vms={"build-1": 8192},
        starting={"creating": Claim.sandbox(1024, 4096), "wake": Claim.wake(128)},
    )
    assert load.kept_pool_mib() == 256 + 512 + 1024 + 8192 + 128
    # A new VM's own claim asks for its whole volume: its RAM is not kept twice.
    assert load.kept_pool_mib({"creating": Claim.sandbox(1024, 4096)}) == 256 + 512 + 8192 + 128


def test_the_refusal_says_what_ran_short_by_how_much_and_when_to_retry() -> None:
    _, refusal = _fill(Policy(), ROOMY)
    assert "committed_memory is short by 114 MiB" in refusal.message
    assert "needs 352 MiB, 238 MiB left" in refusal.message
    assert refusal.details == {
        "resource": "committed_memory",
        "needed": 352,
        "available": 238,
        "unit": "MiB",
        "retry_after_s": 30,
    }


def test_admission_stops_exactly_where_available_memory_would_fall_below_the_reserve() -> None:
    policy = Policy(memory_reserve_mib=2000)
    at_boundary = replace(HOST, memory_available_mib=2000 + START)
    assert shortage(policy, at_boundary, _load(), {"a": DEFAULT}) is None
    below = replace(at_boundary, memory_available_mib=2000 + START - 1)
    refusal = shortage(policy, below, _load(), {"a": DEFAULT}, sandbox_id="sb-x")
    assert refusal is not None and refusal.resource == "memory"
    assert (refusal.needed, refusal.available) == (START, START - 1)
    assert refusal.sandbox_id == "sb-x"


def test_starts_in_flight_hold_memory_and_pool_room_not_yet_visible_on_the_host() -> None:
    policy = Policy(memory_reserve_mib=2000, pool_reserve_mib=1000)
    host = replace(HOST, memory_available_mib=2000 + 2 * START)
    one_starting = _load(starting={"a": DEFAULT})
    assert shortage(policy, host, one_starting, {"b": DEFAULT}) is None
    two_starting = _load(starting={"a": DEFAULT, "b": DEFAULT})
    refusal = shortage(policy, host, two_starting, {"c": DEFAULT})
    assert refusal is not None and refusal.resource == "memory" and refusal.available == 0
    # The same for the pool: each start keeps its memory's worth of room to hibernate,
    # and a new one asks for its whole volume.
    pool = replace(HOST, pool_free_mib=1000 + DEFAULT_MEMORY_MIB + VOLUME)
    assert shortage(policy, pool, one_starting, {"b": DEFAULT}) is None
    refusal = shortage(policy, pool, two_starting, {"c": DEFAULT})
    assert refusal is not None and refusal.resource == "pool"


def test_hibernated_sandboxes_hold_no_memory_but_paused_and_creating_ones_do() -> None:
    policy = Policy()
    full = _running(125)
    assert shortage(policy, ROOMY, _load(full), {"x": DEFAULT}) is not None
    hibernated = _running(125, HIBERNATED)
    assert shortage(policy, ROOMY, _load(hibernated), {"x": DEFAULT}) is None
    assert _load(hibernated).committed_mib() == 0
    for state in (SandboxState.PAUSED, SandboxState.CREATING):
        assert _load(_running(3, state)).committed_mib() == 3 * CHARGE
    assert _load(_running(3, SandboxState.ERROR)).committed_mib() == 0


def test_a_fork_of_n_is_admitted_as_n_sandboxes_all_or_none() -> None:
    policy = Policy()
    # Room for exactly four more under the commitment limit (44238 MiB).
    load = _load(_running((44238 - 4 * CHARGE) // CHARGE))
    four = {f"child-{i}": DEFAULT for i in range(4)}
    assert shortage(policy, ROOMY, load, four) is None
    five = four | {"child-4": DEFAULT}
    refusal = shortage(policy, ROOMY, load, five, sandbox_id="parent")
    assert refusal is not None
    assert refusal.needed == 5 * CHARGE and refusal.available < 5 * CHARGE
    assert "no room for 5 more VMs" in refusal.message and refusal.sandbox_id == "parent"


def test_a_wake_needs_no_pool_room_but_a_pool_below_its_reserve_admits_nothing() -> None:
    policy = Policy(pool_reserve_mib=1000)
    wake = {"sb-0": Claim.wake(DEFAULT_MEMORY_MIB)}
    at_reserve = replace(HOST, pool_free_mib=1000)
    assert shortage(policy, at_reserve, _load(_running(1, HIBERNATED)), wake) is None
    refusal = shortage(policy, at_reserve, _load(), {"new": DEFAULT})
    assert refusal is not None and refusal.resource == "pool"
    assert (refusal.needed, refusal.available) == (VOLUME, 0)
    below = replace(HOST, pool_free_mib=999)
    refusal = shortage(policy, below, _load(_running(1, HIBERNATED)), wake)
    assert refusal is not None and refusal.resource == "pool" and refusal.available == -1


def test_the_operators_cap_counts_sandboxes_in_any_state_and_no_node_vm() -> None:
    policy = Policy(max_sandboxes=3)
    load = _load(
        {"a": Resident(RUNNING, 256), "b": Resident(HIBERNATED, 256)},
        node_vms={"build-1": 1024},
        starting={"pool-1": Claim.node_vm(256, DEFAULT_DISK_MIB)},
    )
    assert shortage(policy, HOST, load, {"c": DEFAULT}) is None
    refusal = shortage(policy, HOST, load, {"c": DEFAULT, "d": DEFAULT})
    assert refusal is not None and refusal.resource == "sandboxes"
    assert (refusal.needed, refusal.available, refusal.unit) == (2, 1, "sandboxes")
    assert "the node has 2 of at most 3" in refusal.message
    # A pool refill or a wake adds no sandbox: the cap does not stop it.
    assert (
        shortage(
            Policy(max_sandboxes=2), HOST, load, {"pool-2": Claim.node_vm(256, DEFAULT_DISK_MIB)}
        )
        is None
    )


def test_the_nodes_own_vms_and_starts_count_once_each_towards_committed_memory() -> None:
    load = _load(
        {"a": Resident(SandboxState.CREATING, 256)},
        node_vms={"build-1": 1024},
        starting={
            "a": DEFAULT,
            "build-1": Claim.node_vm(1024, DEFAULT_DISK_MIB),
            "pool-1": Claim.node_vm(256, DEFAULT_DISK_MIB),
        },
    )
    assert load.committed_mib() == 2 * CHARGE + 1024 + VM_OVERHEAD_MIB
    assert load.sandbox_count() == 1


@pytest.mark.parametrize(
    ("memory_total_mib", "pool_total_mib", "reserve", "pool_reserve"),
    [
        (4 * GIB, 5 * GIB, 1024, 1024),  # the floors
        (24 * GIB, 20 * GIB, 2457, 2048),  # a tenth
        (256 * GIB, 1024 * GIB, 8192, 32768),  # the ceilings
    ],
)
def test_default_reserves_are_a_tenth_within_their_bounds(
    memory_total_mib: int, pool_total_mib: int, reserve: int, pool_reserve: int
) -> None:
    host = Host(memory_total_mib, memory_total_mib, pool_total_mib, pool_total_mib)
    assert Policy().memory_reserve(host) == reserve
    assert Policy().pool_reserve(host) == pool_reserve
    assert Policy().commit_limit(host) == 2 * (memory_total_mib - reserve)
    chosen = Policy(memory_reserve_mib=0, pool_reserve_mib=5, memory_overcommit=1.0)
    assert (chosen.memory_reserve(host), chosen.pool_reserve(host)) == (0, 5)
    assert chosen.commit_limit(host) == memory_total_mib


def test_negative_a_lower_overcommit_admits_fewer_and_a_tiny_host_none() -> None:
    admitted, refusal = _fill(Policy(memory_overcommit=1.0), ROOMY)
    assert admitted == 22119 // CHARGE and refusal.resource == "committed_memory"
    tiny = Host(
        memory_total_mib=1024, memory_available_mib=900, pool_total_mib=GIB, pool_free_mib=GIB
    )
    assert _fill(Policy(), tiny)[0] == 0


def test_capacity_info_reports_the_figures_and_the_room_left_for_default_sandboxes() -> None:
    load = _load(_running(100), starting={"next": DEFAULT})
    info = capacity_info(Policy(), ROOMY, load)
    assert info.memory_committed_mib == 101 * CHARGE
    assert info.memory_commit_limit_mib == 44238
    assert (info.memory_reserve_mib, info.pool_reserve_mib) == (2457, 6553)
    assert (info.memory_starting_mib, info.pool_kept_mib) == (START, 101 * DEFAULT_MEMORY_MIB)
    assert info.starting == 1 and info.max_sandboxes is None
    assert info.room == (44238 - 101 * CHARGE) // CHARGE == 24
    # Room is what admission would grant: one more than it is gets refused.
    for i in range(info.room):
        load = _load(dict(load.sandboxes), starting={**load.starting, f"n{i}": DEFAULT})
    assert shortage(Policy(), ROOMY, load, {"one-more": DEFAULT}) is not None
    capped = capacity_info(Policy(max_sandboxes=101), ROOMY, _load(_running(100)))
    assert capped.room == 1 and capped.max_sandboxes == 101


def test_the_host_is_measured_from_meminfo_and_the_pools_statvfs(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       24684084 kB\nMemFree:        17190316 kB\n"
        "MemAvailable:   23707552 kB\nHugePages_Total:       0\n"
    )
    host = measure_host(tmp_path, meminfo)
    stat = os.statvfs(tmp_path)
    assert (host.memory_total_mib, host.memory_available_mib) == (24105, 23151)
    assert host.pool_total_mib == stat.f_blocks * stat.f_frsize // (1024 * 1024)
    assert 0 < host.pool_free_mib <= host.pool_total_mib


def test_negative_an_unreadable_host_is_unavailable_not_admitted(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 1024 kB\n")  # no MemAvailable
    with pytest.raises(Unavailable, match="cannot measure"):
        measure_host(tmp_path, meminfo)
    with pytest.raises(Unavailable, match="cannot measure"):
        measure_host(tmp_path / "no-pool", Path("/proc/meminfo"))
