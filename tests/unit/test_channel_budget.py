"""The budget of a guest channel (space.node.channel._budget, issue 17 probe 3).

The arithmetic runs on an injected clock; the channel tests use a FakeGuest on a
socketpair (a flood, a few late CREDITs, a throttled reader) and a real spaced
(tests/unit/_guest_harness.py) for a fast legitimate stream.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import struct
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from space.node.api import ExecRequest, Unavailable
from space.node.channel import GuestChannel
from space.node.channel._budget import (
    FRAMES_PER_S,
    MAX_SENSELESS_FRAMES,
    BudgetLimits,
    ChannelAbuse,
    ChannelBudget,
)
from space.node.channel._core import READ_CHUNK_BYTES
from space.node.core.sandbox import LiveSandbox
from space.node.core.state import SandboxRecord
from space.node.core.token_bucket import TokenBucket
from space.node.vmm.qemu import QemuVM, VmConfig
from space.protocol import FrameKind
from tests.fake_guest import FakeGuest, connect
from tests.unit._guest_harness import run_with_channel

SANDBOX = "sb-flooder"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def credit_frame(stream: int) -> bytes:
    return struct.pack(">IBI", 9, FrameKind.CREDIT, stream) + struct.pack(">I", 1)


def keepalive_pong() -> bytes:
    return struct.pack(">IBI", 5 + 5, FrameKind.PONG, 0) + b"alive"


# -- the arithmetic --


def test_a_token_bucket_starts_full_and_refills_at_its_rate_up_to_its_burst() -> None:
    clock = Clock()
    bucket = TokenBucket(rate_per_s=100, burst=50, clock=clock)
    assert bucket.tokens == 50
    bucket.charge(80)
    assert bucket.tokens == -30
    assert bucket.wait_s() == pytest.approx(0.3)
    clock.now += 0.25
    assert bucket.wait_s() == pytest.approx(0.05)
    clock.now += 0.1
    assert bucket.wait_s() == 0
    clock.now += 10
    assert bucket.tokens == 50


def test_negative_a_token_bucket_without_a_rate_is_refused() -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate_per_s=0, burst=1, clock=Clock())


def test_the_budget_throttles_past_either_bucket_and_reads_on_once_refilled() -> None:
    clock = Clock()
    budget = ChannelBudget(
        BudgetLimits(frames_per_s=1000, frame_burst=1000, bytes_per_s=10_000, byte_burst=10_000),
        clock,
    )
    budget.charge(1000, 10_000)  # exactly the burst: no wait
    assert budget.throttle_s() == 0
    budget.charge(1, 0)
    assert budget.throttle_s() == pytest.approx(0.001)
    clock.now += 1
    budget.charge(0, 20_000)  # the bytes bucket alone: 10,000 B of debt at 10,000 B/s
    assert budget.throttle_s() == pytest.approx(1.0)
    assert budget.throttled == 2
    assert (budget.frames_read, budget.bytes_read) == (1001, 30_000)


def test_negative_a_guest_over_budget_without_a_break_for_abuse_after_s_is_abuse() -> None:
    clock = Clock()
    limits = BudgetLimits(frames_per_s=1000, frame_burst=1000, abuse_after_s=5)
    budget = ChannelBudget(limits, clock)
    budget.charge(2000, 0)
    while clock.now < 104.9:  # the reader waits out each debt and overdraws again
        clock.now += budget.throttle_s()
        budget.charge(1100, 0)
    clock.now = 105.0
    with pytest.raises(ChannelAbuse, match=r"over budget for 5\.0 s .*1,000 frames/s"):
        budget.throttle_s()


def test_a_guest_that_comes_back_under_budget_starts_a_new_abuse_period() -> None:
    clock = Clock()
    budget = ChannelBudget(
        BudgetLimits(frames_per_s=1000, frame_burst=1000, abuse_after_s=5), clock
    )
    budget.charge(2000, 0)
    assert budget.throttle_s() > 0
    clock.now += 4.9
    assert budget.throttle_s() == 0  # refilled: the period ends
    budget.charge(2000, 0)
    assert budget.throttle_s() > 0
    clock.now += 1.5
    budget.charge(2000, 0)
    assert budget.throttle_s() > 0  # 1.5 s over, not 6.4 s


def test_negative_a_flood_that_dips_under_budget_for_a_moment_stays_over_budget() -> None:
    clock = Clock()
    budget = ChannelBudget(
        BudgetLimits(frames_per_s=1000, frame_burst=1000, abuse_after_s=5), clock
    )
    budget.charge(2000, 0)
    while clock.now < 105.0:
        clock.now += budget.throttle_s() + 0.01  # overslept: 10 tokens to spare
        budget.charge(5, 0)  # a short read leaves the bucket above zero
        assert budget.throttle_s() == 0
        budget.charge(1100, 0)
    with pytest.raises(ChannelAbuse):
        budget.throttle_s()


def test_senseless_frames_are_tolerated_up_to_the_limit_per_window() -> None:
    clock = Clock()
    budget = ChannelBudget(clock=clock)
    for _ in range(MAX_SENSELESS_FRAMES):
        budget.senseless("late CREDIT")
    clock.now += 10  # a new window
    for _ in range(MAX_SENSELESS_FRAMES):
        budget.senseless("late CREDIT")
    with pytest.raises(ChannelAbuse, match=f"{MAX_SENSELESS_FRAMES + 1:,} senseless frames"):
        budget.senseless("late CREDIT")


def test_the_default_rate_is_above_the_busiest_legitimate_traffic_measured() -> None:
    # 27,000 frames/s for 0.4 s (tiny flushed writes through spaced as a host process)
    # fits the burst on top of the rate; see the constants' comments.
    assert FRAMES_PER_S >= 20_000 and BudgetLimits().frame_burst >= 27_000 * 0.4


# -- the channel --


def test_negative_a_flood_of_credit_for_unknown_streams_closes_the_channel_with_a_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="space.node.channel")
    reasons: list[str] = []

    async def main() -> None:
        channel, guest = await connect(SANDBOX, channel_options={"on_abuse": reasons.append})
        try:
            pending = asyncio.create_task(channel.stat("x"))
            await guest.frame()  # the OPEN
            guest.writer.write(credit_frame(9999) * (MAX_SENSELESS_FRAMES + 1))
            with pytest.raises(Unavailable, match="guest channel abuse") as failure:
                async with asyncio.timeout(5):
                    await pending
            assert failure.value.sandbox_id == SANDBOX
            assert channel.closed
        finally:
            await channel.close()
            await guest.close()
        assert channel.abuse is not None and "senseless frames" in channel.abuse

    asyncio.run(main())
    assert len(reasons) == 1 and "CREDIT for stream 9999" in reasons[0]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and SANDBOX in warnings[0].getMessage()
    assert warnings[0].levelno == logging.WARNING


def test_a_few_late_credits_for_finished_streams_are_tolerated() -> None:
    async def main() -> None:
        channel, guest = await connect(SANDBOX)
        serving: asyncio.Task[None] | None = None
        try:
            for _ in range(50):
                pending = asyncio.create_task(channel.remove("x"))
                while (opened := await _next_open(guest)) is None:
                    pass
                guest.send_json(FrameKind.RESULT, opened, {"ok": True})
                await pending
                guest.send(FrameKind.CREDIT, opened, struct.pack(">I", 10))
            serving = asyncio.create_task(guest.serve_pings())
            assert await channel.ping(timeout_s=2) < 1
            assert not channel.closed and channel.abuse is None
        finally:
            if serving is not None:
                serving.cancel()
            await channel.close()
            await guest.close()

    asyncio.run(main())


async def _next_open(guest: FakeGuest) -> int | None:
    frame = await guest.frame()
    if frame.kind is FrameKind.PING:
        guest.send(FrameKind.PONG, 0, frame.payload)
        return None
    return frame.stream


def test_over_budget_reading_pauses_instead_of_burning_cpu() -> None:
    limits = BudgetLimits(frames_per_s=2000, frame_burst=2000, abuse_after_s=60)

    async def main() -> None:
        channel, guest = await connect(SANDBOX, channel_options={"budget": limits})
        flood = keepalive_pong() * 10_000  # well-formed frames, only signs of life

        async def write() -> None:
            while True:
                guest.writer.write(flood)
                await guest.writer.drain()  # blocks once the host stops reading

        writing = asyncio.create_task(write())
        try:
            started, cpu = time.monotonic(), time.process_time()
            await asyncio.sleep(1.0)
            elapsed, used = time.monotonic() - started, time.process_time() - cpu
        finally:
            writing.cancel()
            await channel.close()
            await guest.close()
        budget = channel.budget
        assert budget.throttled > 0
        # What the budget allows, plus at most one chunk read before the pause.
        allowed = 2000 + 2000 * elapsed + READ_CHUNK_BYTES // len(keepalive_pong())
        assert budget.frames_read <= allowed
        assert used < 0.5 * elapsed  # host and fake guest together, mostly asleep

    asyncio.run(main())


def test_negative_a_guest_over_budget_for_long_is_disconnected_as_abuse() -> None:
    limits = BudgetLimits(frames_per_s=2000, frame_burst=2000, abuse_after_s=0.5)
    reasons: list[str] = []

    async def main() -> None:
        abused = asyncio.Event()

        def on_abuse(reason: str) -> None:
            reasons.append(reason)
            abused.set()

        options = {"budget": limits, "on_abuse": on_abuse}
        channel, guest = await connect(SANDBOX, channel_options=options)
        flood = keepalive_pong() * 10_000

        async def write() -> None:
            while not channel.closed:
                guest.writer.write(flood)
                await guest.writer.drain()

        writing = asyncio.create_task(write())
        try:
            async with asyncio.timeout(5):
                await abused.wait()
            assert channel.closed
        finally:
            writing.cancel()
            await channel.close()
            await guest.close()

    asyncio.run(main())
    # Noticed at the first pause past abuse_after_s (each pause here waits out a chunk).
    assert len(reasons) == 1
    assert re.search(r"over budget for (\d+\.\d) s \(limits 2,000 frames/s", reasons[0])


def test_a_fast_legitimate_stream_is_not_throttled(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: object) -> tuple[int, int]:
        stream = await channel.exec(ExecRequest(cmd="yes | head -c 64000000"))
        received = 0
        async for event in stream:
            received += len(getattr(event, "data", b""))
        return received, channel.budget.throttled

    received, throttled = run_with_channel(tmp_path, body)
    assert received == 64_000_000
    assert throttled == 0


class _StubVm:
    """The QemuVM surface LiveSandbox uses to connect and to stop an abusive guest."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.alive = True
        self.kills = 0
        self.killed = asyncio.Event()
        self._agent = (reader, writer)

    async def open_agent(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return self._agent

    async def kill(self) -> None:
        self.kills += 1
        self.alive = False
        self.killed.set()


def _live(sandbox_id: str) -> LiveSandbox:
    record = cast(SandboxRecord, SimpleNamespace(sandbox_id=sandbox_id))
    return LiveSandbox(record=record, config=cast(VmConfig, None))


async def _connected(sandbox: LiveSandbox) -> tuple[_StubVm, FakeGuest]:
    host_sock, guest_sock = socket.socketpair()
    vm = _StubVm(*await asyncio.open_unix_connection(sock=host_sock))
    guest = FakeGuest(*await asyncio.open_unix_connection(sock=guest_sock))
    sandbox.vm = cast(QemuVM, vm)
    answering = asyncio.create_task(guest.answer_hello())
    await sandbox.connect(hello_timeout_s=2)
    await answering
    return vm, guest


def test_negative_a_sandbox_whose_guest_abuses_the_channel_has_its_vm_killed() -> None:
    sandbox = _live(SANDBOX)

    async def main() -> None:
        vm, guest = await _connected(sandbox)
        channel = sandbox.channel
        assert channel is not None
        try:
            guest.writer.write(credit_frame(7) * (MAX_SENSELESS_FRAMES + 1))
            async with asyncio.timeout(5):
                await vm.killed.wait()
            assert channel.closed
            await asyncio.sleep(0.05)
            assert vm.kills == 1
            vm.alive = True  # even were it alive, no new channel is opened to it
            with pytest.raises(Unavailable, match="senseless frames"):
                await sandbox.connect(hello_timeout_s=2)
        finally:
            await channel.close()
            await guest.close()

    asyncio.run(main())
    assert sandbox.fault is not None and "guest channel abuse" in sandbox.fault


def test_negative_abuse_on_a_handed_over_pool_vm_is_reported_to_its_new_sandbox() -> None:
    pooled, sandbox = _live("sb-pool"), _live(SANDBOX)

    async def main() -> None:
        vm, guest = await _connected(pooled)
        channel = pooled.channel
        assert channel is not None
        sandbox.vm, pooled.vm, pooled.channel = pooled.vm, None, None
        sandbox.adopt(channel)
        try:
            guest.writer.write(credit_frame(7) * (MAX_SENSELESS_FRAMES + 1))
            async with asyncio.timeout(5):
                await vm.killed.wait()
        finally:
            await channel.close()
            await guest.close()

    asyncio.run(main())
    assert pooled.fault is None
    assert sandbox.fault is not None and "guest channel abuse" in sandbox.fault
