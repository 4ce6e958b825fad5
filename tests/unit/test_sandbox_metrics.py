"""Per-sandbox metrics from the guest to the node: the protocol's bounds, spaced's
sampler, the host's refusal of absurd values, and the node's kept samples."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
from pathlib import Path
from typing import Any, cast

import pytest

from space.guest._metrics import MetricsSampler
from space.node.agent._metrics import MetricsKeeper
from space.node.agent._registry import Registry
from space.node.api import (
    MAX_METRICS_SAMPLES,
    METRICS_INTERVAL_S,
    NotFound,
    SandboxSpec,
    SandboxState,
    Unavailable,
)
from space.node.channel import GuestChannel
from space.protocol import (
    MAX_METRICS_BYTES,
    MAX_METRICS_CPUS,
    METRICS_FIELDS,
    FrameKind,
    Metrics,
    ProtocolError,
    decode_json,
)
from tests.fake_guest import connect

from ._guest_harness import Guest, run_with_channel

GOOD: dict[str, Any] = {
    "cpu_count": 2,
    "cpu_used_pct": 12.5,
    "mem_used": 100 << 20,
    "mem_total": 256 << 20,
    "disk_used": 300 << 20,
    "disk_total": 2048 << 20,
}


# -- the protocol's bounds --


def test_a_well_formed_result_decodes_and_encodes_back() -> None:
    metrics = Metrics.from_result({"ok": True, **GOOD})
    assert metrics.to_result() == {"ok": True, **GOOD}
    assert tuple(GOOD) == METRICS_FIELDS


@pytest.mark.parametrize(
    "field, value",
    [
        ("cpu_count", 1),
        ("cpu_count", MAX_METRICS_CPUS),
        ("cpu_used_pct", 0),
        ("cpu_used_pct", 100.0),
        ("mem_used", 0),
        ("mem_used", 256 << 20),
        ("disk_total", MAX_METRICS_BYTES),
    ],
)
def test_values_at_the_exact_bounds_are_accepted(field: str, value: object) -> None:
    assert getattr(Metrics.from_result({**GOOD, field: value}), field) == value


@pytest.mark.parametrize(
    "field, value",
    [
        ("cpu_count", 0),
        ("cpu_count", MAX_METRICS_CPUS + 1),
        ("cpu_count", True),
        ("cpu_count", 2.0),
        ("cpu_count", "2"),
        ("cpu_count", None),
        ("cpu_used_pct", -0.01),
        ("cpu_used_pct", 100.01),
        ("cpu_used_pct", math.nan),
        ("cpu_used_pct", math.inf),
        ("cpu_used_pct", False),
        ("cpu_used_pct", "50"),
        ("mem_used", (256 << 20) + 1),
        ("mem_used", -1),
        ("mem_used", 1e300),
        ("mem_total", 0),
        ("mem_total", MAX_METRICS_BYTES + 1),
        ("disk_used", 2**64),
        ("disk_total", None),
    ],
)
def test_negative_absurd_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ProtocolError, match=field):
        Metrics.from_result({**GOOD, field: value})


# -- spaced's sampler --


def _proc(tmp_path: Path, cpu: str, cpus: int = 2) -> MetricsSampler:
    lines = [f"cpu  {cpu} 0 0", *(f"cpu{n} 1 1 1 1 1 0 0 0 0 0" for n in range(cpus)), "intr 1"]
    (tmp_path / "stat").write_text("\n".join(lines) + "\n")
    meminfo = "MemTotal:       262144 kB\nMemFree:         10000 kB\nMemAvailable:   196608 kB\n"
    (tmp_path / "meminfo").write_text(meminfo)
    return MetricsSampler(str(tmp_path / "stat"), str(tmp_path / "meminfo"))


def test_cpu_use_is_the_busy_share_of_the_ticks_since_the_previous_sample(tmp_path: Path) -> None:
    async def main() -> None:
        sampler = _proc(tmp_path, "100 0 100 800 0 0 0 0")
        first = Metrics.from_result(await sampler.sample())
        assert (first.cpu_count, first.cpu_used_pct) == (2, 0.0)  # nothing moved in its window
        # 400 more ticks, 200 of them idle or iowait: half busy.
        _proc(tmp_path, "250 0 150 900 100 0 0 0")
        second = Metrics.from_result(await sampler.sample())
        assert second.cpu_used_pct == 50.0
        assert (second.mem_total, second.mem_used) == (256 << 20, 64 << 20)
        disk = os.statvfs("/")
        assert second.disk_total == disk.f_blocks * disk.f_frsize
        assert 0 < second.disk_used <= second.disk_total

    asyncio.run(main())


def test_negative_counters_that_went_back_are_measured_afresh_not_negative(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        sampler = _proc(tmp_path, "900 0 900 900 0 0 0 0")
        await sampler.sample()
        _proc(tmp_path, "1 0 1 1 0 0 0 0")  # a restored VM's counters
        assert Metrics.from_result(await sampler.sample()).cpu_used_pct == 0.0

    asyncio.run(main())


def test_spaced_answers_system_metrics_of_its_own_machine(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        first = await channel.metrics()
        assert first.cpu_count == os.cpu_count()
        assert 0 < first.mem_used < first.mem_total and 0 < first.disk_used <= first.disk_total
        assert 0 <= (await channel.metrics()).cpu_used_pct <= 100

    run_with_channel(tmp_path, body)


# -- a hostile guest --


@pytest.mark.parametrize(
    "answer",
    [
        GOOD | {"mem_used": (256 << 20) + 1},
        GOOD | {"cpu_used_pct": 1e9},
        GOOD | {"cpu_count": 1_000_000},
        GOOD | {"disk_total": 2**62, "disk_used": 1},
        {"ok": True},
    ],
)
def test_negative_a_guest_reporting_absurd_metrics_loses_its_channel(
    answer: dict[str, object],
) -> None:
    async def main() -> None:
        channel, guest = await connect("sb-liar")
        try:
            call = asyncio.create_task(channel.metrics())
            opened = await guest.frame()
            assert decode_json(opened.payload) == {"op": "system.metrics"}
            guest.send_json(FrameKind.RESULT, opened.stream, {"ok": True} | answer)
            with pytest.raises(Unavailable) as caught:
                await call
            assert caught.value.sandbox_id == "sb-liar"
            assert channel.closed
        finally:
            await channel.close()
            await guest.close()

    asyncio.run(main())


# -- the node's kept samples --


class _Record:
    def __init__(self, state: SandboxState, guest: str = "qemu", cpus: int = 2) -> None:
        self.state = state
        self.guest = guest
        self.spec = SandboxSpec("sb", cpus=cpus)


class _Sandbox:
    def __init__(self, state: SandboxState, guest: str = "qemu", cpus: int = 2) -> None:
        self.record = _Record(state, guest, cpus)


class _Registry:
    def __init__(self) -> None:
        self.sandboxes: dict[str, _Sandbox] = {}

    def get(self, sandbox_id: str) -> _Sandbox:
        if sandbox_id not in self.sandboxes:
            raise NotFound(f"no sandbox {sandbox_id}", sandbox_id=sandbox_id)
        return self.sandboxes[sandbox_id]


class _Guest:
    def __init__(self) -> None:
        self.asked = 0
        self.busy = GOOD["cpu_used_pct"]

    async def metrics(self) -> Metrics:
        self.asked += 1
        return Metrics.from_result({**GOOD, "cpu_used_pct": self.busy})


def _keeper() -> tuple[MetricsKeeper, _Registry, _Guest, list[float]]:
    registry, guest, now = _Registry(), _Guest(), [1_800_000_000.0]
    keeper = MetricsKeeper(cast(Registry, registry), clock=lambda: now[0])
    return keeper, registry, guest, now


def test_the_node_samples_a_running_sandbox_at_most_every_interval_and_keeps_a_bounded_ring() -> (
    None
):
    async def main() -> None:
        keeper, registry, guest, now = _keeper()
        registry.sandboxes["sb"] = _Sandbox(SandboxState.RUNNING)

        async def channel(sandbox_id: str) -> GuestChannel:
            return cast(GuestChannel, guest)

        first = await keeper.sandbox_metrics("sb", channel)
        assert [s.timestamp for s in first] == [now[0]] and first[0].mem_total == 256 << 20
        now[0] += METRICS_INTERVAL_S - 0.1
        assert await keeper.sandbox_metrics("sb", channel) == first and guest.asked == 1
        for _ in range(MAX_METRICS_SAMPLES + 5):
            now[0] += METRICS_INTERVAL_S
            samples = await keeper.sandbox_metrics("sb", channel)
        assert len(samples) == MAX_METRICS_SAMPLES and samples[-1].timestamp == now[0]
        assert all(a.timestamp < b.timestamp for a, b in itertools.pairwise(samples))

    asyncio.run(main())


@pytest.mark.parametrize(
    "guest, cpus, busy, want",
    [
        ("qemu", 2, 12.5, (2, 12.5)),  # its own CPUs: as the guest says
        ("gvisor", 1, 12.5, (1, 25.0)),  # the host's 2 seen, its 1 reported
        ("gvisor", 2, 12.5, (2, 12.5)),
        ("gvisor", 1, 75.0, (1, 100.0)),  # bounded: a burst the quota had not caught
    ],
)
def test_a_gvisor_sandbox_s_cpu_figures_are_of_its_spec_s_cpus(
    guest: str, cpus: int, busy: float, want: tuple[int, float]
) -> None:
    async def main() -> None:
        keeper, registry, guest_stub, _ = _keeper()
        registry.sandboxes["sb"] = _Sandbox(SandboxState.RUNNING, guest, cpus)
        guest_stub.busy = busy

        async def channel(sandbox_id: str) -> GuestChannel:
            return cast(GuestChannel, guest_stub)

        (sample,) = await keeper.sandbox_metrics("sb", channel)
        assert (sample.cpu_count, sample.cpu_used_pct) == want

    asyncio.run(main())


@pytest.mark.parametrize("state", [SandboxState.PAUSED, SandboxState.HIBERNATED])
def test_a_sleeping_sandbox_answers_its_kept_samples_and_is_never_woken(
    state: SandboxState,
) -> None:
    async def main() -> None:
        keeper, registry, guest, now = _keeper()
        sandbox = registry.sandboxes["sb"] = _Sandbox(SandboxState.RUNNING)
        opened: list[str] = []

        async def channel(sandbox_id: str) -> GuestChannel:
            opened.append(sandbox_id)
            return cast(GuestChannel, guest)

        kept = await keeper.sandbox_metrics("sb", channel)
        sandbox.record.state = state
        now[0] += 10 * METRICS_INTERVAL_S
        assert await keeper.sandbox_metrics("sb", channel) == kept
        assert opened == ["sb"]
        registry.sandboxes["new"] = _Sandbox(state)
        assert await keeper.sandbox_metrics("new", channel) == []
        with pytest.raises(NotFound):
            await keeper.sandbox_metrics("gone", channel)
        assert opened == ["sb"]

    asyncio.run(main())
