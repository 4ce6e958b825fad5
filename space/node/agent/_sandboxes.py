"""The sandboxes of a node: create, delete, pause, resume, hibernate, restore, fork.

``Node`` delegates the sandbox calls of NodeService here. Each holds the sandbox's lock
(space.node.agent._registry) and persists every transition before it is acknowledged;
the transitions through saved memory are space.node.agent._lifecycle's. Every VM they
start (a create, fork children, a wake, a restore of a sandbox without a VM) is
admitted by capacity first (space.node.agent._admission). Every method raises
space.node.api errors only.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from space.node.agent._egress import parse_policy
from space.node.agent._gvisor_trees import boot_gvisor
from space.node.agent._hidden import start_command
from space.node.agent._pool import Pools
from space.node.agent._registry import Registry
from space.node.agent._snapshots import SAVEABLE, Snapshots
from space.node.api import (
    Conflict,
    InvalidArgument,
    SandboxSpec,
    SandboxState,
    SandboxStatus,
    SnapshotInfo,
)
from space.node.core.capacity import Claim, holds_memory, volume_limit_mib
from space.node.core.sandbox import (
    LiveSandbox,
    check_memory_ops,
    check_not_held,
    not_allowed,
    settled,
    with_console,
)
from space.node.core.state import SandboxRecord
from space.node.core.template import Template
from space.node.core.validation import (
    MAX_FORK_CHILDREN,
    check_compatible,
    check_id,
    check_spec,
    resolve_guest,
)

__all__ = ["Sandboxes"]


class Sandboxes:
    """The lifecycle of the node's sandboxes (see the module docstring)."""

    def __init__(self, registry: Registry, *, snapshots: Snapshots, pools: Pools) -> None:
        self._registry = registry
        self._snapshots = snapshots
        self._pools = pools
        self._network = registry.network
        self._life = registry.life
        self._store = registry.store

    async def create_sandbox(self, spec: SandboxSpec) -> SandboxStatus:
        """Boot a sandbox; returns once its guest daemon said hello (state RUNNING).

        Idempotent: the same spec for an existing id returns its status; a different
        spec raises Conflict. Raises InvalidArgument (resources out of range), NotFound
        (template), InsufficientCapacity (no room on the node: nothing was started),
        Unavailable/Timeout (boot failed; the message carries the console tail). On
        failure or cancellation nothing of the sandbox remains.
        """
        registry = self._registry
        template = check_spec(spec, registry.catalog.resolve)
        # A policy out of bounds is refused before anything starts.
        parse_policy(spec.egress, spec.sandbox_id, registry.config.egress_bounds)
        guest = resolve_guest(
            spec,
            kvm=registry.accelerator == "kvm",
            without_kvm=registry.config.guest_without_kvm,
            offered=registry.guest_types,
        )
        snapshot = self._snapshots.compatible(spec) if spec.from_snapshot else None
        if snapshot is not None:
            if spec.guest == "auto":
                guest = snapshot.guest  # the only type that can run it
            check_compatible(spec, snapshot, guest)
        lock = registry.lock(spec.sandbox_id)
        async with lock:
            existing = registry.sandboxes.get(spec.sandbox_id)
            if existing is not None:
                if existing.record.spec != spec:
                    raise Conflict(
                        "a sandbox with this id and another spec exists", sandbox_id=spec.sandbox_id
                    )
                return existing.record.status()
            # Admitted the same way whether a warm-pool VM serves it or not.
            with registry.admission.claim(
                {spec.sandbox_id: Claim.sandbox(spec.memory_mib, spec.disk_mib)}
            ):
                sandbox = self._register(spec, template, lock, guest)
                try:
                    await self._start(sandbox, template, snapshot)
                    await self._network.apply(sandbox)
                except BaseException as exc:
                    tail = sandbox.console_tail()
                    await asyncio.shield(registry.destroy(sandbox))
                    error = with_console(exc, spec.sandbox_id, tail)
                    if error is exc:
                        raise
                    raise error from exc
            return sandbox.record.status()

    def _register(
        self, spec: SandboxSpec, template: Template, lock: asyncio.Lock, guest: str
    ) -> LiveSandbox:
        registry = self._registry
        record = SandboxRecord(
            spec=spec,
            state=SandboxState.CREATING,
            created_at=time.time(),
            template_digest=template.digest,
            run_dir=str(registry.run_root / spec.sandbox_id),
            template_env=dict(template.env),
            workdir=template.workdir,
            guest=guest,
        )
        sandbox = registry.live(record, lock)
        registry.sandboxes[spec.sandbox_id] = sandbox
        return sandbox

    async def _start(
        self, sandbox: LiveSandbox, template: Template, snapshot: SnapshotInfo | None
    ) -> None:
        """Run a registered sandbox: from a snapshot, its template's ready state (a warm
        pool VM if one waits) or a boot."""
        registry = self._registry
        if sandbox.record.guest == "gvisor" and snapshot is None:
            await self._boot_gvisor(sandbox, template)
        elif snapshot is not None:
            image = registry.pool.snapshot_path(snapshot.snapshot_id)
            async with registry.starts:
                await self._life.create_from_image(sandbox, image, head=snapshot.snapshot_id)
        elif template.ready is not None and template.ready_fits(sandbox.record.spec):
            await self._pools.create(sandbox, template.ready)
        else:
            async with registry.starts:
                await self._boot(sandbox, template)

    async def _boot(self, sandbox: LiveSandbox, template: Template) -> None:
        spec = sandbox.record.spec
        config = self._registry.config
        self._store.save(sandbox.record)  # CREATING, before anything exists to clean up
        await self._registry.pool.create_sandbox_volume(
            sandbox.record.volume,
            template.volume,
            disk_mib=spec.disk_mib,
            limit_mib=volume_limit_mib(spec.disk_mib, spec.memory_mib),
            grow=template.pristine,
        )
        await sandbox.launch(qemu_binary=config.qemu_binary)
        self._store.save(sandbox.mark(SandboxState.CREATING))  # now with the pid
        channel = await sandbox.connect(hello_timeout_s=config.boot_timeout_s)
        await start_command(channel, template, check=False)
        self._store.save(sandbox.mark(SandboxState.RUNNING))
        sandbox.watch(self._registry.on_vm_exit, config.console_max_bytes)

    async def _boot_gvisor(self, sandbox: LiveSandbox, template: Template) -> None:
        """A gVisor sandbox: a warm pool's handed over if one waits and has the
        template's shape (its egress policy is applied after, as for a VM), else one
        restored from the template's gVisor ready state if it has one and the shape
        fits, else one booted on the template's tree (space.node.agent._gvisor_trees)."""
        registry = self._registry
        if await self._pools.take_gvisor(sandbox, template):
            return
        async with registry.starts:
            if template.gvisor_ready is not None and template.ready_fits(sandbox.record.spec):
                await self._life.create_from_image(sandbox, template.gvisor_ready)
                return  # watched from its restore on
            await boot_gvisor(registry, sandbox, template)
        sandbox.watch(registry.on_vm_exit, registry.config.console_max_bytes)

    async def delete_sandbox(self, sandbox_id: str) -> None:
        """Stop the VM and remove volume, sockets and state; idempotent (unknown ids too)."""
        check_id(sandbox_id)
        async with self._registry.lock(sandbox_id):
            sandbox = self._registry.sandboxes.get(sandbox_id)
            if sandbox is None:
                await self._registry.remove_leftovers(sandbox_id)
                return
            await asyncio.shield(self._registry.destroy(sandbox))

    async def pause_sandbox(self, sandbox_id: str) -> SandboxStatus:
        """Stop the sandbox's vCPUs, keeping its memory; returns its status (PAUSED).

        Idempotent (a PAUSED sandbox's status comes back as is). PAUSED is persisted
        after QEMU confirmed and before returning. Raises NotFound, Conflict naming the
        state (neither running nor paused), Unavailable (QMP failed: still RUNNING). A
        cancellation waits for QEMU's answer (at most the QMP timeout), so the record
        and the VM agree.
        """
        return await self._switch(sandbox_id, SandboxState.PAUSED)

    async def resume_sandbox(self, sandbox_id: str) -> SandboxStatus:
        """Run a PAUSED or HIBERNATED sandbox again; returns its status (RUNNING).

        Idempotent, persisted and raising as ``pause_sandbox``. The guest's clock is set
        to the host's (it stood still meanwhile). Waking a hibernated sandbox loads its
        saved memory into a new VM, admitted like a create: InsufficientCapacity if the
        node has no room; if that or the wake fails before the guest ran, it stays
        HIBERNATED. Every guest operation on a hibernated sandbox wakes it this way.
        """
        return await self._switch(sandbox_id, SandboxState.RUNNING)

    async def hibernate_sandbox(self, sandbox_id: str) -> SandboxStatus:
        """Save a RUNNING or PAUSED sandbox's memory into its volume and stop its VM.

        Idempotent (a HIBERNATED sandbox's status comes back). HIBERNATED is persisted
        once memory and device state are durable, before QEMU exits. Raises NotFound,
        Conflict naming the state, Unavailable/Timeout (the sandbox then returns to
        its prior state). A cancellation lets the transition finish.
        """
        return await self._switch(sandbox_id, SandboxState.HIBERNATED)

    async def _switch(self, sandbox_id: str, target: SandboxState) -> SandboxStatus:
        check_id(sandbox_id)
        async with self._registry.lock(sandbox_id):
            sandbox = self._registry.get(sandbox_id)
            await self.switch_locked(sandbox, target)
            return sandbox.record.status()

    async def switch_locked(self, sandbox: LiveSandbox, target: SandboxState) -> None:
        """Move between RUNNING, PAUSED and HIBERNATED; the caller holds the lock.

        Each step is persisted once done; a cancellation lets it finish.
        """
        state = sandbox.record.state
        if state == target:
            return
        check_memory_ops(_VERBS[target], sandbox)
        check_not_held(_VERBS[target], sandbox)
        if state not in SAVEABLE or (state, target) == (
            SandboxState.HIBERNATED,
            SandboxState.PAUSED,
        ):
            raise not_allowed(_VERBS[target], sandbox)
        await settled(self._transition(sandbox, state, target))

    async def _transition(
        self, sandbox: LiveSandbox, state: SandboxState, target: SandboxState
    ) -> None:
        if target == SandboxState.HIBERNATED:
            await self._life.hibernate(sandbox)
        elif target == SandboxState.PAUSED:
            await sandbox.pause()
            self._store.save(sandbox.mark(target))
        else:
            if state == SandboxState.HIBERNATED:
                admission = self._registry.admission
                with admission.claim(_waking(sandbox), sandbox_id=sandbox.sandbox_id):
                    await self._life.wake(sandbox)
            else:
                await sandbox.resume()
                self._store.save(sandbox.mark(target))
                await self._life.sync_clock(sandbox)
            await self._network.trust_after_resume(sandbox)

    async def restore_sandbox(self, sandbox_id: str, snapshot_id: str) -> SandboxStatus:
        """Roll a sandbox back to a snapshot: disk, memory and processes; RUNNING after.

        Allowed unless the sandbox is CREATING. The guest gets a fresh identity. Raises
        NotFound (sandbox, snapshot), InvalidArgument (resources differ), Conflict,
        InsufficientCapacity (a sandbox without a VM, hibernated or errored, gets one
        again only if the node has room; it is left as it was), Unavailable/Timeout
        (the sandbox is then ERROR: restore again or delete it).
        """
        check_id(snapshot_id, "snapshot id")
        registry = self._registry
        async with registry.lock(sandbox_id), registry.lock(f"snapshot/{snapshot_id}"):
            sandbox = registry.get(sandbox_id)
            snapshot = self._snapshots.find(snapshot_id)
            check_compatible(sandbox.record.spec, snapshot, sandbox.record.guest)
            check_memory_ops("restore", sandbox)
            if sandbox.record.state == SandboxState.CREATING:
                raise not_allowed("restore", sandbox)
            check_not_held("restore", sandbox)
            # A sandbox without a VM (hibernated, or errored) gets one again.
            claims = {} if holds_memory(sandbox.record.state) else _waking(sandbox)
            with registry.admission.claim(claims, sandbox_id=sandbox_id):
                await settled(self._life.restore(sandbox, snapshot))
            sandbox.trusted_ca = None  # the guest's files are the snapshot's now
            await self._network.apply(sandbox)
            return sandbox.record.status()

    async def fork_sandbox(self, sandbox_id: str, child_ids: list[str]) -> list[SandboxStatus]:
        """New RUNNING sandboxes, one per id, each a copy of the sandbox as it is now.

        The parent (RUNNING, PAUSED or HIBERNATED) keeps its state. All or nothing: if
        a child fails, every child is removed and the error raised. Raises
        InvalidArgument (ids), Conflict (an id exists, or the parent's state),
        InsufficientCapacity (no room for all the children: none is started),
        Unavailable/Timeout.
        """
        ids = [check_id(child) for child in child_ids]
        if not 1 <= len(ids) <= MAX_FORK_CHILDREN or len(set(ids)) != len(ids):
            raise InvalidArgument(
                f"want 1..{MAX_FORK_CHILDREN} distinct child ids", sandbox_id=sandbox_id
            )
        registry = self._registry
        async with registry.lock(sandbox_id):
            parent = registry.get(sandbox_id)
            check_memory_ops("fork", parent)
            if parent.record.state not in SAVEABLE:
                raise not_allowed("fork", parent)
            taken = [c for c in ids if c in registry.sandboxes or c == sandbox_id]
            if taken:
                raise Conflict(f"sandbox {taken[0]} exists", sandbox_id=sandbox_id)
            spec = parent.record.spec
            claims = {child: Claim.sandbox(spec.memory_mib, spec.disk_mib) for child in ids}
            with registry.admission.claim(claims, sandbox_id=sandbox_id):
                children = [self._child(parent, child) for child in ids]
                try:
                    await settled(self._life.fork(parent, children))
                    for child in children:
                        await self._network.apply(child)
                except BaseException:
                    for child in children:
                        await asyncio.shield(registry.destroy(child))
                    raise
            return [child.record.status() for child in children]

    async def get_sandbox(self, sandbox_id: str) -> SandboxStatus:
        return self._registry.get(sandbox_id).record.status()

    async def list_sandboxes(self) -> list[SandboxStatus]:
        return [s.record.status() for s in self._registry.sandboxes.values()]

    def _child(self, parent: LiveSandbox, child_id: str) -> LiveSandbox:
        record = replace(
            parent.record,
            spec=replace(parent.record.spec, sandbox_id=child_id, from_snapshot=None),
            state=SandboxState.CREATING,
            created_at=time.time(),
            run_dir=str(self._registry.run_root / child_id),
            volume=child_id,
            vmm_pid=None,
            error=None,
            pending=None,
        )
        child = self._registry.live(record)
        self._registry.sandboxes[child_id] = child
        return child


def _waking(sandbox: LiveSandbox) -> dict[str, Claim]:
    """The claim of a sandbox whose VM starts again from the memory image it has."""
    return {sandbox.sandbox_id: Claim.wake(sandbox.record.spec.memory_mib)}


_VERBS = {
    SandboxState.PAUSED: "pause",
    SandboxState.RUNNING: "resume",
    SandboxState.HIBERNATED: "hibernate",
}
