"""The node agent's core: sandboxes as QEMU VMs on btrfs snapshots of a template.

``Node`` implements space.node.api.interface.NodeService. Every transition is written to
``data_dir/sandboxes/<id>.json`` before it is acknowledged; ``Node.start`` re-adopts
every VM that survived the previous node process (QEMU outlives it) and cleans up the
rest, so nothing leaks and nothing is lost. ``close`` leaves VMs running for the next
start; ``shutdown`` deletes them all.

Every method raises space.node.api.errors leaves only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from space.node.agent._builds import Builds
from space.node.agent._catalog import Catalog
from space.node.agent._egress_ops import EgressOps, parse_policy
from space.node.agent._guest_ops import GuestOps
from space.node.agent._hidden import start_command
from space.node.agent._lifecycle import Lifecycle, Registry
from space.node.agent._pool import WarmPool
from space.node.agent._recovery import recover
from space.node.agent._snapshot_ops import SAVEABLE, SnapshotOps
from space.node.agent._template_ops import TemplateOps
from space.node.api import (
    Conflict,
    InvalidArgument,
    NodeError,
    NodeInfo,
    NotFound,
    ResourceExhausted,
    SandboxSpec,
    SandboxState,
    SandboxStatus,
)
from space.node.core.config import NodeConfig, resolve_node_id
from space.node.core.sandbox import LiveSandbox, not_allowed, settled, vm_config_for, with_console
from space.node.core.state import SandboxRecord, SnapshotStore, StateStore
from space.node.core.template import Template, prepare_template
from space.node.core.validation import MAX_FORK_CHILDREN, check_compatible, check_id, check_spec
from space.node.egress.audit import AuditLog
from space.node.network.gateway_client import GatewayProcess
from space.node.storage.btrfs import BtrfsPool
from space.node.vmm.accel import Accelerator, detect_accelerator

__all__ = ["Node"]

log = logging.getLogger(__name__)


class Node(GuestOps, SnapshotOps, TemplateOps, EgressOps):
    """The sandboxes of one host. Start with ``await Node.start(config)``."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        node_id: str,
        pool: BtrfsPool,
        catalog: Catalog,
        accel: Accelerator,
        gateway: GatewayProcess,
    ) -> None:
        self.config = config
        self._gateway = gateway
        self._audit = AuditLog(config.data_dir / "egress" / "audit")
        self._ca_dir = config.data_dir / "egress" / "ca"
        self._boot_id = secrets.token_hex(8)
        self.node_id = node_id
        self.pool = pool
        self.accelerator: Accelerator = accel
        self._catalog = catalog
        self._store = StateStore(config.data_dir / "sandboxes")
        self._run_root = config.effective_run_dir
        self._sandboxes: dict[str, LiveSandbox] = {}
        # Per-id locks that outlive a sandbox only while someone waits on them.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._tasks: set[asyncio.Task[None]] = set()
        self._snapshots = SnapshotStore(config.data_dir / "snapshots")
        self._life = Lifecycle(config, pool, self._store, self._snapshots, self._on_vm_exit)
        #: Warm pools by template digest.
        self._pools: dict[str, WarmPool] = {}
        # A hundred QEMUs starting at once on a small host time out on their sockets;
        # creates past the bound wait their turn instead.
        self._starts = asyncio.Semaphore(config.max_parallel_starts)
        self._builds = Builds(
            self._registry, catalog, config.data_dir / "builds", self._make_ready, self._drop_build
        )

    # startup and shutdown

    @classmethod
    async def start(
        cls, config: NodeConfig, *, progress: Callable[[str], None] | None = None
    ) -> Node:
        """Prepare pool, base template and accelerator, then re-adopt surviving VMs.

        Raises Unavailable if the pool, the image build or the import fails. Blocks for
        the first image build (minutes); later starts reuse the cached image.
        """
        say = progress or (lambda _msg: None)
        node_id = resolve_node_id(config)
        pool = await BtrfsPool.open(
            pool_path=config.pool_path, data_dir=config.data_dir, size_gib=config.pool_size_gib
        )
        gateway: GatewayProcess | None = None
        try:
            gateway = await GatewayProcess.start(
                config.data_dir / "egress",
                config.effective_resolvers,
                config.effective_upstream_ca,
            )
            template = await prepare_template(pool, config, say)
            accel = await detect_accelerator(
                config.accel,
                data_dir=config.data_dir,
                kernel=template.volume.kernel,
                initrd=template.volume.initrd,
                kernel_digest=template.digest,
                qemu_binary=config.qemu_binary,
            )
            say(f"accelerator: {accel}")
            catalog = Catalog(template, pool, config.data_dir / "templates")
            for problem in catalog.load():
                say(problem)
            node = cls(
                config, node_id=node_id, pool=pool, catalog=catalog, accel=accel, gateway=gateway
            )
            await recover(node._registry(), say)
            await node._network_at_start(say)
            await node._remove_untagged_templates(say)
            for built in catalog.builds():
                await node._ready_at_start(built, say)
        except BaseException:
            if gateway is not None:
                await gateway.abandon()
            with contextlib.suppress(NodeError):
                await pool.close(unmount=pool.fresh_mount)
            raise
        return node

    async def close(self, *, unmount_pool: bool = False) -> None:
        """Disconnect from every VM but leave them running (the next start re-adopts them),
        and the egress gateway with them (it ends if no sandbox is left to serve).

        Warm pool VMs (no tenant data) are deleted. ``unmount_pool`` also unmounts a
        loop-file pool; only for tests and tools, and only once no VM uses it any more.
        """
        await self._builds.close()
        for warm in self._pools.values():
            await warm.close()
        self._pools.clear()
        for sandbox in list(self._sandboxes.values()):
            await sandbox.disconnect()
        self._sandboxes.clear()
        await self._gateway.close()
        with contextlib.suppress(OSError):
            self._run_root.rmdir()  # only once empty: VMs left running keep their dirs
        await self.pool.close(unmount=unmount_pool)

    async def shutdown(self, *, unmount_pool: bool = False) -> None:
        """Delete every sandbox and snapshot, then ``close``. For tests and demos."""
        for sandbox_id in list(self._sandboxes):
            await self.delete_sandbox(sandbox_id)
        for snapshot in self._snapshots.load_all()[0]:
            await self.delete_snapshot(snapshot.snapshot_id)
        await self.close(unmount_pool=unmount_pool)

    async def info(self) -> NodeInfo:
        return NodeInfo(
            node_id=self.node_id,
            accelerator=self.accelerator,
            templates=sorted({template.name for template in self._catalog.tagged()}),
            sandboxes=len(self._sandboxes),
            pools=[warm.info() for warm in self._pools.values()],
            boot_id=self._boot_id,
        )

    # lifecycle

    async def create_sandbox(self, spec: SandboxSpec) -> SandboxStatus:
        """Boot a sandbox; returns once its guest daemon said hello (state RUNNING).

        Idempotent: the same spec for an existing id returns its status; a different
        spec raises Conflict. Raises InvalidArgument (resources out of range), NotFound
        (template), ResourceExhausted (max_sandboxes), Unavailable/Timeout (boot failed;
        the message carries the console tail). On failure or cancellation nothing of the
        sandbox remains.
        """
        template = check_spec(spec, self._catalog.resolve)
        parse_policy(spec.egress, spec.sandbox_id)
        snapshot = self._compatible_snapshot(spec) if spec.from_snapshot else None
        lock = self._lock(spec.sandbox_id)
        async with lock:
            existing = self._sandboxes.get(spec.sandbox_id)
            if existing is not None:
                if existing.record.spec != spec:
                    raise Conflict(
                        "a sandbox with this id and another spec exists", sandbox_id=spec.sandbox_id
                    )
                return existing.record.status()
            self._check_capacity(1, spec.sandbox_id)
            record = SandboxRecord(
                spec=spec,
                state=SandboxState.CREATING,
                created_at=time.time(),
                template_digest=template.digest,
                run_dir=str(self._run_root / spec.sandbox_id),
                template_env=dict(template.env),
                workdir=template.workdir,
            )
            sandbox = self._live(record, lock)
            self._sandboxes[spec.sandbox_id] = sandbox
            try:
                if snapshot is not None:
                    image = self.pool.snapshot_path(snapshot.snapshot_id)
                    async with self._starts:
                        await self._life.create_from_image(
                            sandbox, image, head=snapshot.snapshot_id
                        )
                elif template.ready is not None and template.ready_fits(spec):
                    await self._from_ready_state(sandbox, template.ready)
                else:
                    async with self._starts:
                        await self._boot(sandbox, template)
                await self._apply_egress(sandbox)
            except BaseException as exc:
                tail = sandbox.console_tail()
                await asyncio.shield(self._destroy(sandbox))
                error = with_console(exc, spec.sandbox_id, tail)
                if error is exc:
                    raise
                raise error from exc
            return sandbox.record.status()

    async def _boot(self, sandbox: LiveSandbox, template: Template) -> None:
        spec = sandbox.record.spec
        self._store.save(sandbox.record)  # CREATING, before anything exists to clean up
        await self.pool.create_sandbox_volume(
            sandbox.record.volume, template.volume, disk_mib=spec.disk_mib, grow=template.pristine
        )
        await sandbox.launch(qemu_binary=self.config.qemu_binary)
        self._store.save(sandbox.mark(SandboxState.CREATING))  # now with the pid
        channel = await sandbox.connect(hello_timeout_s=self.config.boot_timeout_s)
        await start_command(channel, template, check=False)
        self._store.save(sandbox.mark(SandboxState.RUNNING))
        sandbox.watch(self._on_vm_exit, self.config.console_max_bytes)

    async def delete_sandbox(self, sandbox_id: str) -> None:
        """Stop the VM and remove volume, sockets and state; idempotent (unknown ids too)."""
        check_id(sandbox_id)
        async with self._lock(sandbox_id):
            sandbox = self._sandboxes.get(sandbox_id)
            if sandbox is None:
                await self._remove_leftovers(sandbox_id)
                return
            await asyncio.shield(self._destroy(sandbox))

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
        saved memory into a new VM; if that fails before the guest ran, it stays
        HIBERNATED.
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
        async with self._lock(sandbox_id):
            sandbox = self._get(sandbox_id)
            await self._switch_locked(sandbox, target)
            return sandbox.record.status()

    async def _switch_locked(self, sandbox: LiveSandbox, target: SandboxState) -> None:
        """Move between RUNNING, PAUSED and HIBERNATED; the caller holds the lock.

        Each step is persisted once done; a cancellation lets it finish.
        """
        state = sandbox.record.state
        if state == target:
            return
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
                await self._life.wake(sandbox)
            else:
                await sandbox.resume()
                self._store.save(sandbox.mark(target))
                await self._life.sync_clock(sandbox)
            await self._trust_after_resume(sandbox)

    # restore, fork

    async def restore_sandbox(self, sandbox_id: str, snapshot_id: str) -> SandboxStatus:
        """Roll a sandbox back to a snapshot: disk, memory and processes; RUNNING after.

        Allowed unless the sandbox is CREATING. The guest gets a fresh identity. Raises
        NotFound (sandbox, snapshot), InvalidArgument (resources differ), Conflict,
        Unavailable/Timeout (the sandbox is then ERROR: restore again or delete it).
        """
        check_id(snapshot_id, "snapshot id")
        async with self._lock(sandbox_id), self._lock(f"snapshot/{snapshot_id}"):
            sandbox = self._get(sandbox_id)
            snapshot = self._snapshot(snapshot_id)
            check_compatible(sandbox.record.spec, snapshot)
            if sandbox.record.state == SandboxState.CREATING:
                raise not_allowed("restore", sandbox)
            await settled(self._life.restore(sandbox, snapshot))
            sandbox.trusted_ca = None  # the guest's files are the snapshot's now
            await self._apply_egress(sandbox)
            return sandbox.record.status()

    async def fork_sandbox(self, sandbox_id: str, child_ids: list[str]) -> list[SandboxStatus]:
        """New RUNNING sandboxes, one per id, each a copy of the sandbox as it is now.

        The parent (RUNNING, PAUSED or HIBERNATED) keeps its state. All or nothing: if
        a child fails, every child is removed and the error raised. Raises
        InvalidArgument (ids), Conflict (an id exists, or the parent's state),
        ResourceExhausted (max_sandboxes), Unavailable/Timeout.
        """
        ids = [check_id(child) for child in child_ids]
        if not 1 <= len(ids) <= MAX_FORK_CHILDREN or len(set(ids)) != len(ids):
            raise InvalidArgument(
                f"want 1..{MAX_FORK_CHILDREN} distinct child ids", sandbox_id=sandbox_id
            )
        async with self._lock(sandbox_id):
            parent = self._get(sandbox_id)
            if parent.record.state not in SAVEABLE:
                raise not_allowed("fork", parent)
            taken = [c for c in ids if c in self._sandboxes or c == sandbox_id]
            if taken:
                raise Conflict(f"sandbox {taken[0]} exists", sandbox_id=sandbox_id)
            self._check_capacity(len(ids), sandbox_id)
            children = [self._child(parent, child) for child in ids]
            try:
                await settled(self._life.fork(parent, children))
                for child in children:
                    await self._apply_egress(child)
            except BaseException:
                for child in children:
                    await asyncio.shield(self._destroy(child))
                raise
            return [child.record.status() for child in children]

    def _check_capacity(self, more: int, sandbox_id: str) -> None:
        if len(self._sandboxes) + more > self.config.max_sandboxes:
            raise ResourceExhausted(
                f"node has {len(self._sandboxes)} sandboxes, {more} more would pass the "
                f"limit of {self.config.max_sandboxes}",
                sandbox_id=sandbox_id,
            )

    def _child(self, parent: LiveSandbox, child_id: str) -> LiveSandbox:
        record = replace(
            parent.record,
            spec=replace(parent.record.spec, sandbox_id=child_id, from_snapshot=None),
            state=SandboxState.CREATING,
            created_at=time.time(),
            run_dir=str(self._run_root / child_id),
            volume=child_id,
            vmm_pid=None,
            error=None,
            pending=None,
        )
        child = self._live(record)
        self._sandboxes[child_id] = child
        return child

    async def get_sandbox(self, sandbox_id: str) -> SandboxStatus:
        return self._get(sandbox_id).record.status()

    async def list_sandboxes(self) -> list[SandboxStatus]:
        return [s.record.status() for s in self._sandboxes.values()]

    # internals

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is not None:
            return sandbox.lock
        lock = self._locks.get(sandbox_id)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[sandbox_id] = lock
        return lock

    def _get(self, sandbox_id: str) -> LiveSandbox:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            raise NotFound(f"no sandbox {sandbox_id!r} on this node", sandbox_id=sandbox_id)
        return sandbox

    def _live(self, record: SandboxRecord, lock: asyncio.Lock | None = None) -> LiveSandbox:
        sid = record.sandbox_id
        config = vm_config_for(
            record,
            volume=self.pool.sandbox_path(record.volume),
            # Every template boots the base image's kernel with its command line.
            base_cmdline=self._catalog.base.kernel_cmdline,
            accel=self.accelerator,
            console_log=self._console_log(sid),
        )
        return LiveSandbox(record=record, config=config, lock=lock or self._lock(sid))

    async def _destroy(self, sandbox: LiveSandbox) -> None:
        """Take a sandbox apart completely; logs (never raises) what it cannot remove."""
        sid = sandbox.sandbox_id
        try:
            await sandbox.teardown()
        except NodeError as exc:
            log.error("sandbox %s: stopping its VM failed: %s", sid, exc)
        await self._drop_network(sid, Path(sandbox.record.run_dir))
        await self._remove_leftovers(sid, volume=sandbox.record.volume)
        shutil.rmtree(sandbox.record.run_dir, ignore_errors=True)  # a pool VM's keeps its name
        self._sandboxes.pop(sid, None)

    async def _remove_leftovers(self, sandbox_id: str, *, volume: str | None = None) -> None:
        """Remove volume (``volume``, else the one named after the id), run dir, console
        logs and state of a sandbox whose VM is gone."""
        try:
            await self.pool.delete_sandbox_volume(volume or sandbox_id)
        except NodeError as exc:
            log.error("sandbox %s: deleting its volume failed: %s", sandbox_id, exc)
        await self._drop_network(sandbox_id, self._run_root / sandbox_id)
        shutil.rmtree(self._run_root / sandbox_id, ignore_errors=True)
        console = self._console_log(sandbox_id)
        for path in (console, console.with_suffix(".old")):
            path.unlink(missing_ok=True)
        self._store.remove(sandbox_id)

    def _console_log(self, sandbox_id: str) -> Path:
        return self._store.directory / f"{sandbox_id}.console.log"

    def _on_vm_exit(self, sandbox: LiveSandbox) -> None:
        """QEMU exited without being asked: the sandbox goes to ERROR (kept for inspection)."""
        tail = sandbox.console_tail()
        log.warning(
            "sandbox %s: qemu exited unexpectedly; console tail:\n%s", sandbox.sandbox_id, tail
        )
        error = f"VM exited unexpectedly; console tail: {tail[-500:]}"
        self._store.save(sandbox.mark(SandboxState.ERROR, error=error))
        task = asyncio.get_running_loop().create_task(sandbox.disconnect())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _registry(self) -> Registry:
        return Registry(
            life=self._life,
            sandboxes=self._sandboxes,
            live=self._live,
            destroy=self._destroy,
            remove_leftovers=self._remove_leftovers,
            build_network=self._build_network,
        )


_VERBS = {
    SandboxState.PAUSED: "pause",
    SandboxState.RUNNING: "resume",
    SandboxState.HIBERNATED: "hibernate",
}
