"""Every way a node starts a VM asks its admission first (issue 15).

The node's services run here over a registry whose host figures the test sets and
whose VM starts are stand-ins (no QEMU): what is checked is who claims what, when the
claim is held and released, and that a refusal leaves nothing behind.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from space.limits import DEFAULT_DISK_MIB, DEFAULT_MEMORY_MIB
from space.node.agent._admission import Admission
from space.node.agent._pool import make_pool_vm
from space.node.agent._sandboxes import Sandboxes
from space.node.api import (
    InsufficientCapacity,
    NotFound,
    SandboxSpec,
    SandboxState,
    SnapshotInfo,
)
from space.node.core.capacity import (
    VM_OVERHEAD_MIB,
    Claim,
    Host,
    Policy,
    Resident,
    volume_limit_mib,
)
from space.node.core.config import NodeConfig
from space.node.core.state import SandboxRecord
from space.node.core.template import Template
from space.node.storage.btrfs import TemplateVolume

pytestmark = pytest.mark.anyio

RUNNING, HIBERNATED = SandboxState.RUNNING, SandboxState.HIBERNATED
CHARGE = DEFAULT_MEMORY_MIB + VM_OVERHEAD_MIB
START = VM_OVERHEAD_MIB + DEFAULT_MEMORY_MIB // 4
VOLUME = volume_limit_mib(DEFAULT_DISK_MIB, DEFAULT_MEMORY_MIB)
RESERVE = 1000
#: Reserves of 1000 MiB, no overcommit: the host's figures alone decide.
POLICY = Policy(memory_reserve_mib=RESERVE, pool_reserve_mib=RESERVE, memory_overcommit=1.0)
TEMPLATE = Template(
    name="base",
    tag="latest",
    volume=TemplateVolume("base", "d1", Path("/pool/templates/base/d1")),
    kernel_cmdline="console=ttyS0",
    min_disk_mib=1024,
    pristine=True,
    ready=Path("/pool/templates/base/d1.ready"),
)


def _host(*, commit_room: int = 100, start_room: int = 100, pool_room: int = 100) -> Host:
    """A host with room for that many default sandboxes by each guard."""
    return Host(
        memory_total_mib=RESERVE + commit_room * CHARGE,
        memory_available_mib=RESERVE + start_room * START,
        pool_total_mib=100_000,
        # Each new sandbox asks for its volume; each admitted one keeps its RAM's room.
        pool_free_mib=RESERVE + VOLUME + (pool_room - 1) * DEFAULT_MEMORY_MIB,
    )


@dataclass
class _Sandbox:
    record: SandboxRecord
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    held_until: float | None = None  # not held for a move (issue 19)

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    def console_tail(self) -> str:
        return ""


class _Starts:
    """Stands in for every VM start: records it, holds it until ``go`` is set, then
    marks the sandbox RUNNING (or fails with ``error``)."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.started: list[str] = []
        self.go = asyncio.Event()
        self.go.set()
        self.error: Exception | None = None

    async def run(self, sandbox: _Sandbox) -> None:
        self.started.append(sandbox.sandbox_id)
        await self.go.wait()
        if self.error is not None:
            raise self.error
        sandbox.record = replace(sandbox.record, state=RUNNING)

    # Pools.create and the Lifecycle calls the services make
    async def create(self, sandbox: _Sandbox, ready: Path) -> None:
        await self.run(sandbox)

    async def wake(self, sandbox: _Sandbox) -> None:
        await self.run(sandbox)

    async def restore(self, sandbox: _Sandbox, snapshot: SnapshotInfo) -> None:
        await self.run(sandbox)

    async def fork(self, parent: _Sandbox, children: list[_Sandbox]) -> None:
        for child in children:
            await self.run(child)

    async def create_from_image(self, vm: _Sandbox, image: Path) -> None:
        await self.run(vm)


class _Registry:
    """The part of space.node.agent._registry.Registry the services use here."""

    def __init__(self, host: Host, policy: Policy = POLICY) -> None:
        self.host = host
        self.sandboxes: dict[str, _Sandbox] = {}
        self.admission = Admission(policy, residents=self._residents, measure=lambda: self.host)
        self.config = NodeConfig(data_dir=Path("/tmp/space-test"))
        self.starts_done = _Starts(self.config)
        self.life = self.starts_done
        self.catalog = SimpleNamespace(resolve=lambda ref: TEMPLATE)
        self.network = SimpleNamespace(apply=_nothing, trust_after_resume=_nothing)
        self.store = SimpleNamespace(save=lambda record: None)
        self.run_root = Path("/run/space-test")
        self.accelerator = "tcg"
        self.guest_types = ["qemu"]
        self.starts = asyncio.Semaphore(4)
        self.destroyed: list[str] = []
        self._locks: dict[str, asyncio.Lock] = {}

    def _residents(self) -> dict[str, Resident]:
        return {
            sid: Resident(s.record.state, s.record.spec.memory_mib)
            for sid, s in self.sandboxes.items()
        }

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        sandbox = self.sandboxes.get(sandbox_id)
        return sandbox.lock if sandbox else self._locks.setdefault(sandbox_id, asyncio.Lock())

    def get(self, sandbox_id: str) -> _Sandbox:
        if sandbox_id not in self.sandboxes:
            raise NotFound(sandbox_id)
        return self.sandboxes[sandbox_id]

    def live(self, record: SandboxRecord, lock: asyncio.Lock | None = None) -> _Sandbox:
        return _Sandbox(record, lock or self.lock(record.sandbox_id))

    async def destroy(self, sandbox: _Sandbox) -> None:
        self.destroyed.append(sandbox.sandbox_id)
        self.sandboxes.pop(sandbox.sandbox_id, None)
        self.admission.release(sandbox.sandbox_id)

    def put(self, sandbox_id: str, state: SandboxState) -> _Sandbox:
        """A sandbox the node already has, in ``state``."""
        record = SandboxRecord(
            spec=SandboxSpec(sandbox_id),
            state=state,
            created_at=0.0,
            template_digest="d1",
            run_dir=f"/run/space-test/{sandbox_id}",
        )
        self.sandboxes[sandbox_id] = sandbox = _Sandbox(record)
        return sandbox


async def _nothing(*_: object) -> None:
    return None


def _service(registry: _Registry) -> Sandboxes:
    snapshots = SimpleNamespace(find=lambda sid: _snapshot(sid), compatible=None)
    pools = registry.starts_done
    return Sandboxes(cast(Any, registry), snapshots=cast(Any, snapshots), pools=cast(Any, pools))


def _snapshot(snapshot_id: str) -> SnapshotInfo:
    return SnapshotInfo(snapshot_id, "sb-1", None, 0.0, "base", 1, 256, 2048, 0)


async def test_concurrent_creates_reserve_memory_their_starts_will_take() -> None:
    registry = _Registry(_host(start_room=2))
    service = _service(registry)
    registry.starts_done.go.clear()  # both starts in flight, MemAvailable unchanged
    first = asyncio.create_task(service.create_sandbox(SandboxSpec("sb-1")))
    second = asyncio.create_task(service.create_sandbox(SandboxSpec("sb-2")))
    await asyncio.sleep(0)
    assert registry.admission.info().memory_starting_mib == 2 * START
    with pytest.raises(InsufficientCapacity) as refused:
        await service.create_sandbox(SandboxSpec("sb-3"))
    assert refused.value.resource == "memory"
    assert (refused.value.needed, refused.value.available) == (START, 0)
    assert "sandbox_id" not in refused.value.details  # it never existed
    assert set(registry.sandboxes) == {"sb-1", "sb-2"}
    assert registry.starts_done.started == ["sb-1", "sb-2"]
    registry.starts_done.go.set()
    assert [(await t).state for t in (first, second)] == [RUNNING, RUNNING]
    info = registry.admission.info()
    assert (info.starting, info.memory_starting_mib) == (0, 0)  # released once started


async def test_negative_a_create_beyond_committed_memory_is_refused_and_leaves_nothing() -> None:
    registry = _Registry(_host(commit_room=2))
    service = _service(registry)
    for sid in ("sb-1", "sb-2"):
        await service.create_sandbox(SandboxSpec(sid))
    before = dict(registry.sandboxes)
    with pytest.raises(InsufficientCapacity) as refused:
        await service.create_sandbox(SandboxSpec("sb-3"))
    assert refused.value.resource == "committed_memory"
    assert registry.sandboxes == before and registry.starts_done.started == ["sb-1", "sb-2"]
    assert registry.destroyed == [] and registry.admission.info().starting == 0
    # The same id, asked again once a sandbox hibernated (holding no memory), is admitted.
    registry.sandboxes["sb-1"].record = replace(registry.sandboxes["sb-1"].record, state=HIBERNATED)
    assert (await service.create_sandbox(SandboxSpec("sb-3"))).state == RUNNING


async def test_a_failed_start_releases_its_claim() -> None:
    registry = _Registry(_host(start_room=1))
    service = _service(registry)
    registry.starts_done.error = NotFound("no such thing")
    with pytest.raises(NotFound):
        await service.create_sandbox(SandboxSpec("sb-1"))
    assert registry.destroyed == ["sb-1"] and registry.admission.info().starting == 0
    registry.starts_done.error = None
    assert (await service.create_sandbox(SandboxSpec("sb-2"))).state == RUNNING


async def test_a_fork_of_n_is_admitted_as_n_sandboxes_or_not_at_all() -> None:
    registry = _Registry(_host(commit_room=4))
    registry.put("parent", RUNNING)
    service = _service(registry)
    with pytest.raises(InsufficientCapacity) as refused:
        await service.fork_sandbox("parent", ["c1", "c2", "c3", "c4"])
    assert refused.value.resource == "committed_memory" and refused.value.needed == 4 * CHARGE
    assert refused.value.sandbox_id == "parent"
    assert set(registry.sandboxes) == {"parent"} and registry.starts_done.started == []
    children = await service.fork_sandbox("parent", ["c1", "c2", "c3"])
    assert [c.state for c in children] == [RUNNING] * 3
    assert registry.admission.info().room == 0


async def test_the_operators_cap_refuses_the_sandbox_past_it() -> None:
    registry = _Registry(_host(), replace(POLICY, max_sandboxes=2))
    registry.put("old", HIBERNATED)  # counts: it is a sandbox of the node
    service = _service(registry)
    await service.create_sandbox(SandboxSpec("sb-1"))
    with pytest.raises(InsufficientCapacity) as refused:
        await service.create_sandbox(SandboxSpec("sb-2"))
    assert (refused.value.resource, refused.value.needed, refused.value.available) == (
        "sandboxes",
        1,
        0,
    )


async def test_waking_a_hibernated_sandbox_needs_room_and_it_stays_hibernated_without() -> None:
    registry = _Registry(_host(commit_room=1))
    registry.put("sb-1", RUNNING)
    sleeper = registry.put("sb-2", HIBERNATED)
    service = _service(registry)
    with pytest.raises(InsufficientCapacity) as refused:
        await service.resume_sandbox("sb-2")
    assert refused.value.sandbox_id == "sb-2" and refused.value.resource == "committed_memory"
    assert sleeper.record.state == HIBERNATED and registry.starts_done.started == []
    # A restore would give it a VM again too: refused the same way.
    with pytest.raises(InsufficientCapacity):
        await service.restore_sandbox("sb-2", "sn-1")
    assert sleeper.record.state == HIBERNATED
    registry.sandboxes["sb-1"].record = replace(registry.sandboxes["sb-1"].record, state=HIBERNATED)
    assert (await service.resume_sandbox("sb-2")).state == RUNNING


async def test_restoring_a_sandbox_that_has_a_vm_asks_for_no_room() -> None:
    registry = _Registry(_host(commit_room=1))
    registry.put("sb-1", RUNNING)  # the node is full
    service = _service(registry)
    assert (await service.restore_sandbox("sb-1", "sn-1")).state == RUNNING


async def test_negative_a_pool_refill_on_a_full_node_is_refused_before_it_starts() -> None:
    registry = _Registry(_host(commit_room=1))
    registry.put("sb-1", RUNNING)
    with pytest.raises(InsufficientCapacity) as refused:
        await make_pool_vm(cast(Any, registry), TEMPLATE)
    assert refused.value.resource == "committed_memory"
    assert registry.starts_done.started == [] and registry.admission.info().starting == 0


async def test_the_nodes_own_vms_are_held_until_destroyed() -> None:
    registry = _Registry(_host(commit_room=2))
    registry.admission.hold("build-1", DEFAULT_MEMORY_MIB)
    assert registry.admission.info().memory_committed_mib == CHARGE
    with registry.admission.claim({"ready-1": Claim.node_vm(DEFAULT_MEMORY_MIB, DEFAULT_DISK_MIB)}):
        assert registry.admission.info().room == 0
        sandbox = {"x": Claim.sandbox(DEFAULT_MEMORY_MIB, DEFAULT_DISK_MIB)}
        with pytest.raises(InsufficientCapacity), registry.admission.claim(sandbox):
            pass
    assert registry.admission.info().room == 1  # the claim ended; the held VM stays
    registry.admission.release("build-1")
    registry.admission.release("never-held")  # nothing
    assert registry.admission.info().memory_committed_mib == 0
