"""WarmPool's bookkeeping, with fake VMs and an injected clock (no QEMU here)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from space.node.agent._pool import WarmPool
from space.node.api import InsufficientCapacity, SandboxState, Unavailable
from space.node.core.sandbox import LiveSandbox

from .fakes import FakeClock

pytestmark = pytest.mark.anyio


@dataclass
class _Record:
    state: SandboxState = SandboxState.PAUSED


@dataclass
class _Vm:
    name: str
    vm_alive: bool = True
    record: _Record = field(default_factory=_Record)


class _Maker:
    def __init__(self, fail: int = 0, error: Exception | None = None) -> None:
        self.made: list[_Vm] = []
        self.destroyed: list[str] = []
        self.fail = fail
        self.error = error or Unavailable("no memory")

    async def make(self) -> LiveSandbox:
        await asyncio.sleep(0)
        if self.fail:
            self.fail -= 1
            raise self.error
        vm = _Vm(f"vm{len(self.made)}")
        self.made.append(vm)
        return cast(LiveSandbox, vm)

    async def destroy(self, vm: Any) -> None:
        self.destroyed.append(vm.name)


async def _settle(pool: WarmPool, size: int) -> None:
    async with asyncio.timeout(5):
        while True:  # the pool fills in its own task: let it run until it got there
            if pool.info().size == size:
                return
            await asyncio.sleep(0.001)


def _pool(maker: _Maker, clock: FakeClock, low: int = 1, high: int = 3) -> WarmPool:
    return WarmPool(
        "base",
        make=maker.make,
        destroy=maker.destroy,
        min_size=low,
        max_size=high,
        window_s=60.0,
        clock=clock,
    )


async def test_the_pool_fills_to_its_minimum_and_serves_hits_then_refills() -> None:
    maker, clock = _Maker(), FakeClock()
    pool = _pool(maker, clock)
    pool.start()
    await _settle(pool, 1)

    vm = pool.take()

    assert vm is not None and cast(Any, vm).name == "vm0"
    info = pool.info()
    assert (info.hits, info.misses) == (1, 0)
    await asyncio.sleep(0.05)
    assert len(maker.made) == 1  # no refill while the hit is handed over
    pool.refill()
    await _settle(pool, 1)  # demand of 1 in the window: target 1
    await pool.close()
    assert maker.destroyed == ["vm1"] and pool.info().size == 0


async def test_the_target_follows_demand_within_the_window_and_stays_within_bounds() -> None:
    maker, clock = _Maker(), FakeClock()
    pool = _pool(maker, clock, low=1, high=3)
    assert pool.target == 1
    for _ in range(5):
        pool.take()
    assert pool.target == 3  # 5 creates in the window, clamped to the maximum
    clock.now += 59
    assert pool.target == 3
    clock.now += 2  # the creates left the window
    assert pool.target == 1
    assert pool.info().misses == 5  # never started: every take missed


async def test_negative_a_dead_pool_vm_is_never_handed_out() -> None:
    maker, clock = _Maker(), FakeClock()
    pool = _pool(maker, clock, low=2, high=2)
    pool.start()
    await _settle(pool, 2)
    maker.made[0].vm_alive = False
    maker.made[1].record.state = SandboxState.ERROR

    assert pool.take() is None

    assert pool.info().misses == 1
    await pool.close()
    assert {"vm0", "vm1"} <= set(maker.destroyed)


async def test_negative_a_failing_refill_is_logged_and_retried_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("space.node.agent._pool._RETRY_S", 0.0)
    maker, clock = _Maker(fail=2), FakeClock()
    pool = _pool(maker, clock)
    pool.start()
    await _settle(pool, 1)
    assert len(maker.made) == 1
    await pool.close()


async def test_a_node_short_of_capacity_stops_the_refill_quietly_until_room_returns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("space.node.agent._pool._RETRY_S", 0.0)
    full = InsufficientCapacity("node has no room for 1 more VM", resource="memory")
    maker, clock = _Maker(fail=3, error=full), FakeClock()
    pool = _pool(maker, clock)
    with caplog.at_level(logging.INFO, logger="space.node.agent._pool"):
        pool.start()
        await _settle(pool, 1)
        await pool.close()
    assert len(maker.made) == 1  # made once room returned, after three refusals
    refusals = [r for r in caplog.records if "not refilling" in r.getMessage()]
    assert len(refusals) == 3 and all(r.levelno == logging.INFO for r in refusals)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_negative_sizes_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="min_size"):
        _pool(_Maker(), FakeClock(), low=3, high=2)


async def test_close_waits_for_a_vm_being_made_and_deletes_it_never_cutting_it_short() -> None:
    """A make cancelled in the middle of its VMM's launch could leave that VMM running,
    known to no node: close lets it finish, then deletes it with the others."""
    maker, clock = _Maker(), FakeClock()
    booting, may_finish = asyncio.Event(), asyncio.Event()
    cancelled: list[bool] = []

    async def slow_make() -> LiveSandbox:
        if len(maker.made) == 1:  # the second: a refill after a hit
            booting.set()
            try:
                await may_finish.wait()
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
        return await maker.make()

    pool = WarmPool(
        "base", make=slow_make, destroy=maker.destroy, min_size=1, max_size=1, clock=clock
    )
    pool.start()
    await _settle(pool, 1)
    assert pool.take() is not None
    pool.refill()
    await booting.wait()
    closing = asyncio.create_task(pool.close())
    await asyncio.sleep(0.05)
    assert not closing.done()  # waits for the make
    may_finish.set()
    await closing
    assert cancelled == []
    assert [vm.name for vm in maker.made] == ["vm0", "vm1"]
    assert maker.destroyed == ["vm1"]  # vm0 was handed out
