"""The node's pause/resume plumbing that needs no VM (tests/integration has the rest)."""

from __future__ import annotations

import asyncio

import pytest

from space.node.core.sandbox import settled

pytestmark = pytest.mark.anyio


async def test_a_cancelled_transition_still_runs_to_its_end_before_the_cancellation() -> None:
    steps: list[str] = []

    async def transition() -> None:
        steps.append("qmp")
        await asyncio.sleep(0.05)
        steps.append("persisted")

    caller = asyncio.ensure_future(settled(transition()))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert steps == ["qmp", "persisted"]


async def test_negative_a_failing_transition_raises_its_own_error() -> None:
    async def transition() -> None:
        raise RuntimeError("qmp broke")

    with pytest.raises(RuntimeError, match="qmp broke"):
        await settled(transition())
