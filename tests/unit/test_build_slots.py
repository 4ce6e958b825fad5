"""Template builds share a node's build slots fairly between tenants (issue 17, probe 6).

The real ``Builds`` (unpacking, spec, plan, slots, log) with a fake build body that
runs until the test lets it finish, so the order builds get their slots is seen exactly.
"""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from space.node.agent._build_slots import OPERATOR, BuildSlots, build_owner
from space.node.agent._builder import Planned
from space.node.agent._builds import Builds
from space.node.agent._catalog import Catalog
from space.node.api import (
    BuildEvent,
    BuildFailed,
    BuildLog,
    BuildStream,
    BuildSucceeded,
    InvalidArgument,
    ResourceExhausted,
)
from space.node.core.template import BASE, Template
from space.node.storage.btrfs import BtrfsPool, TemplateVolume

pytestmark = pytest.mark.anyio

#: Node-internal names of two tenants' templates (space/control/template_names.py).
A = "t" + "a" * 16 + "."
B = "t" + "b" * 16 + "."


class _Bodies:
    """A fake build body: each build (by ``name:tag``) runs until ``finish`` is called."""

    def __init__(self, base: Template) -> None:
        self._base = base
        self._gates: dict[str, asyncio.Event] = {}
        self.started: list[str] = []
        self.running: set[str] = set()
        self._changed = asyncio.Event()

    async def __call__(self, planned: Planned, say: Callable[[str], None]) -> Template:
        ref = f"{planned.spec.name}:{planned.spec.tag}"
        self.started.append(ref)
        self.running.add(ref)
        self._changed.set()
        try:
            await self._gates.setdefault(ref, asyncio.Event()).wait()
        finally:
            self.running.discard(ref)
            self._changed.set()
        return replace(self._base, name=planned.spec.name, tag=planned.spec.tag)

    def finish(self, ref: str) -> None:
        self._gates.setdefault(ref, asyncio.Event()).set()

    async def until(self, condition: Callable[[], bool]) -> None:
        """Let the builds run until ``condition`` (of the bodies) holds; a second at most."""
        async with asyncio.timeout(1):
            while not condition():
                self._changed.clear()
                await self._changed.wait()


@pytest.fixture
def base(tmp_path: Path) -> Template:
    path = tmp_path / "pool" / "templates" / BASE / ("b" * 64)
    path.mkdir(parents=True)
    with open(path / "rootfs.img", "wb") as image:
        os.truncate(image.fileno(), 1024 << 20)
    return Template(BASE, "latest", TemplateVolume(BASE, "b" * 64, path), "", 1024, pristine=True)


@pytest.fixture
def bodies(base: Template) -> _Bodies:
    return _Bodies(base)


@pytest.fixture
async def make_builds(
    tmp_path: Path, base: Template, bodies: _Bodies
) -> AsyncIterator[Callable[..., Builds]]:
    """Makes Builds over a real catalog; afterwards each is closed and nothing of any
    build is left: no slot held, no place queued, no work directory."""
    catalog = Catalog(base, BtrfsPool(tmp_path / "pool", image=None, mounted_here=False), tmp_path)
    made: list[Builds] = []

    def make(slots: int = 2, queued_per_owner: int = 4) -> Builds:
        builds = Builds(
            catalog, _work_root(tmp_path), bodies, slots=slots, queued_per_owner=queued_per_owner
        )
        made.append(builds)
        return builds

    yield make
    for builds in made:
        await builds.close()
        assert builds.slots.running == 0 and builds.slots.waiting() == 0
    assert not _work_root(tmp_path).exists() or not any(_work_root(tmp_path).iterdir())


def _work_root(tmp_path: Path) -> Path:
    return tmp_path / "builds"


def _context(name: str, tag: str = "v1", base: str = "debian:bookworm") -> AsyncIterator[bytes]:
    spec = f'name = "{name}"\ntag = "{tag}"\nbase = "{base}"\n'.encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        info = tarfile.TarInfo("space.toml")
        info.size = len(spec)
        archive.addfile(info, io.BytesIO(spec))
    data = buffer.getvalue()

    async def chunks() -> AsyncIterator[bytes]:
        yield data

    return chunks()


async def _events(stream: BuildStream) -> list[BuildEvent]:
    async with asyncio.timeout(1):
        return [event async for event in stream]


def _lines(events: list[BuildEvent]) -> list[str]:
    return [event.line for event in events if isinstance(event, BuildLog)]


def test_the_owner_of_a_build_is_its_tenant_prefix_or_the_operator() -> None:
    assert build_owner(A + "py") == A[:-1]
    assert build_owner(A + "py.v2") == A[:-1]
    assert build_owner("base") == OPERATOR
    assert build_owner("tools.v1") == OPERATOR
    assert build_owner("t" + "a" * 15 + ".py") == OPERATOR  # not a tenant's prefix


async def test_b_s_build_starts_while_a_s_is_running(
    make_builds: Callable[..., Builds], bodies: _Bodies
) -> None:
    builds = make_builds(slots=2)
    await builds.start(_context(A + "slow"))
    await bodies.until(lambda: bodies.running == {A + "slow:v1"})
    b_stream = await builds.start(_context(B + "quick"))
    await bodies.until(lambda: B + "quick:v1" in bodies.running)
    bodies.finish(B + "quick:v1")
    b_events = await _events(b_stream)
    assert isinstance(b_events[-1], BuildSucceeded)
    assert not any("waiting" in line for line in _lines(b_events))
    assert bodies.running == {A + "slow:v1"}


async def test_a_lone_tenant_uses_every_slot(
    make_builds: Callable[..., Builds], bodies: _Bodies
) -> None:
    builds = make_builds(slots=3)
    for name in ("one", "two", "three"):
        await builds.start(_context(A + name))
    await bodies.until(lambda: len(bodies.running) == 3)


async def test_a_s_third_build_waits_while_b_s_runs(
    make_builds: Callable[..., Builds], bodies: _Bodies
) -> None:
    builds = make_builds(slots=2)
    for name in ("one", "two", "three"):
        await builds.start(_context(A + name))
    await bodies.until(lambda: bodies.running == {A + "one:v1", A + "two:v1"})
    b_stream = await builds.start(_context(B + "quick"))
    assert builds.slots.waiting() == 2
    bodies.finish(A + "one:v1")
    # The freed slot goes to B (no build running), not to A's third (A has one).
    await bodies.until(lambda: B + "quick:v1" in bodies.running)
    assert A + "three:v1" not in bodies.started
    bodies.finish(B + "quick:v1")
    b_events = await _events(b_stream)
    assert "waiting for a build slot: 0 builds ahead, 2 running" in _lines(b_events)
    await bodies.until(lambda: A + "three:v1" in bodies.running)


async def test_owners_with_as_many_builds_running_take_turns(
    make_builds: Callable[..., Builds], bodies: _Bodies
) -> None:
    c = "t" + "c" * 16 + "."
    builds = make_builds(slots=1)
    await builds.start(_context(A + "one"))
    await bodies.until(lambda: bool(bodies.running))
    for name in (A + "two", B + "one", c + "one"):
        await builds.start(_context(name))
    for ref in (A + "one:v1", B + "one:v1", c + "one:v1", A + "two:v1"):
        await bodies.until(lambda: bodies.running == {ref})  # noqa: B023 (awaited at once)
        bodies.finish(ref)
    assert bodies.started == [A + "one:v1", B + "one:v1", c + "one:v1", A + "two:v1"]


async def test_negative_a_build_past_the_owners_queue_bound_is_refused_and_its_context_removed(
    make_builds: Callable[..., Builds], bodies: _Bodies, tmp_path: Path
) -> None:
    builds = make_builds(slots=1, queued_per_owner=2)
    await builds.start(_context(A + "running"))
    await bodies.until(lambda: bool(bodies.running))
    for name in ("q1", "q2"):  # exactly the bound: accepted
        await builds.start(_context(A + name))
    before = sorted(_work_root(tmp_path).iterdir())
    with pytest.raises(ResourceExhausted, match="at most 2 may wait") as caught:
        await builds.start(_context(A + "q3"))
    assert caught.value.code == "resource_exhausted"
    assert A not in str(caught.value)  # internal names stay on the node
    assert sorted(_work_root(tmp_path).iterdir()) == before  # its context is gone
    assert len(before) == 3 and builds.slots.waiting(A[:-1]) == 2
    # Another tenant still queues: the bound is per owner.
    await builds.start(_context(B + "other"))
    assert builds.slots.waiting() == 3


async def test_negative_a_refused_spec_or_plan_takes_no_place_in_the_queue(
    make_builds: Callable[..., Builds], bodies: _Bodies, tmp_path: Path
) -> None:
    builds = make_builds(slots=1, queued_per_owner=1)
    await builds.start(_context(A + "running"))
    await bodies.until(lambda: bool(bodies.running))
    with pytest.raises(InvalidArgument, match="no template"):
        await builds.start(_context(A + "x", base="template:nope:latest"))
    with pytest.raises(InvalidArgument) as refused:
        await builds.start(_context("-bad-name-"))
    assert refused.value.message.startswith("space.toml: ")  # not the node's work path
    assert str(tmp_path) not in str(refused.value)
    assert builds.slots.waiting() == 0
    assert len(list(_work_root(tmp_path).iterdir())) == 1
    await builds.start(_context(A + "queued"))  # its one place is still free


async def test_builds_of_one_template_never_run_at_once_and_hold_no_slot_while_waiting(
    make_builds: Callable[..., Builds], bodies: _Bodies
) -> None:
    builds = make_builds(slots=2)
    first = await builds.start(_context(A + "py", tag="v1"))
    await bodies.until(lambda: bool(bodies.running))
    second = await builds.start(_context(A + "py", tag="v2"))
    await builds.start(_context(A + "other"))
    # The other template takes the free slot; the second build of py waits.
    await bodies.until(lambda: bodies.running == {A + "py:v1", A + "other:v1"})
    bodies.finish(A + "py:v1")
    await bodies.until(lambda: A + "py:v2" in bodies.running)
    bodies.finish(A + "py:v2")
    assert isinstance((await _events(first))[-1], BuildSucceeded)
    second_events = await _events(second)
    assert isinstance(second_events[-1], BuildSucceeded)
    assert f"waiting for the running build of {A}py to finish" in _lines(second_events)


async def test_close_cancels_queued_and_running_builds_and_removes_their_contexts(
    make_builds: Callable[..., Builds], bodies: _Bodies, tmp_path: Path
) -> None:
    builds = make_builds(slots=1)
    running = await builds.start(_context(A + "running"))
    await bodies.until(lambda: bool(bodies.running))
    queued = await builds.start(_context(B + "queued"))
    await builds.close()
    for stream in (running, queued):
        outcome = (await _events(stream))[-1]
        assert isinstance(outcome, BuildFailed) and outcome.code == "unavailable"
    assert not bodies.running and bodies.started == [A + "running:v1"]
    assert builds.slots.running == 0 and builds.slots.waiting() == 0
    assert list(_work_root(tmp_path).iterdir()) == []


async def test_a_waiter_cancelled_after_its_grant_gives_the_slot_back() -> None:
    slots = BuildSlots(1, 4)
    first = slots.enqueue(A + "one")
    second = slots.enqueue(B + "one")
    waiter = asyncio.get_running_loop().create_task(slots.wait(second))
    await asyncio.sleep(0)
    slots.leave(first)  # grants the slot to the waiter, which is cancelled before it runs
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert slots.running == 0 and slots.waiting() == 0
    third = slots.enqueue(A + "two")
    assert third.granted.is_set()
