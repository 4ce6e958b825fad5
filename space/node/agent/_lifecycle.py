"""Transitions through saved memory: hibernate, wake, snapshot, restore, fork.

Used by the node's services (space.node.agent), which validate, hold the sandbox's lock
around each call and keep the registry. A running sandbox's guest RAM is in no file:
it is anonymous memory, or a private (copy-on-write) mapping of the memory image it was
woken from, so nothing is written anywhere while it runs. Saving the VM's state
(``vmstate``) writes its RAM into its volume, and volume = disk + memory image, so:

- hibernate: save the state, record HIBERNATED, quit QEMU;
- wake: launch QEMU waiting for a state, load it, record RUNNING, run;
- snapshot: save the state, read-only btrfs snapshot of the volume, publish, run on;
- restore / fork / create from a snapshot: writable btrfs snapshot of a snapshot (or of
  the live volume) as the sandbox's volume, then wake it with a fresh identity;
- create from a template's ready state (an image whose RAM is a file beside a state of
  the devices only): the same, with the RAM mapped private from the ready state's own
  file, so every sandbox of the template shares its clean pages in the page cache.

A gVisor sandbox (issue 21) goes the same ways: its "VM" pauses with ``runsc pause``,
saves with ``runsc checkpoint`` (sealed into ``vmstate`` in its volume, which is its
root directory) and starts from that state with ``runsc restore``, which also runs it.

Each function records a ``Pending`` operation before its first step a crash could
interrupt; space.node.agent._recovery finishes or undoes it on the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

from space.node.api import NodeError, SandboxState, SnapshotInfo, Unavailable
from space.node.core.capacity import volume_limit_mib
from space.node.core.config import NodeConfig
from space.node.core.sandbox import (
    MEMORY_FILE,
    STATE_FILE,
    LiveSandbox,
    fsync_file,
    hostname_for,
    preflush,
)
from space.node.core.state import Pending, SnapshotStore, StateStore
from space.node.storage.btrfs import BtrfsPool, snapshot_subvolume

__all__ = ["Lifecycle", "memory_bytes", "ram_file"]

log = logging.getLogger(__name__)

_ENTROPY_BYTES = 64


def ram_file(volume: Path, image: Path | None) -> Path | None:
    """The RAM file to map private when waking the memory image in ``volume`` (a clone
    of ``image``, if given): None when the saved state holds the RAM.

    A RAM file beside the state is mapped from ``image`` itself where the node can open
    it read-write (a ready state: one file in the page cache for all its sandboxes, and
    the clone's copy goes), else from the volume (a read-only snapshot's image saved
    before RAM was private).
    """
    own = volume / MEMORY_FILE
    if not own.is_file():
        return None
    if image is not None and os.access(image / MEMORY_FILE, os.R_OK | os.W_OK):
        own.unlink()
        return image / MEMORY_FILE
    return own


def _volume_limit(sandbox: LiveSandbox) -> int:
    """What the sandbox's volume may reference (its btrfs quota group's limit)."""
    spec = sandbox.record.spec
    return volume_limit_mib(spec.disk_mib, spec.memory_mib)


def memory_bytes(volume: Path) -> int:
    """Disk bytes of a volume's memory image: device state plus allocated RAM pages."""
    total = 0
    for name in (STATE_FILE, MEMORY_FILE):
        with contextlib.suppress(FileNotFoundError):
            total += (volume / name).stat().st_blocks * 512
    return total


class Lifecycle:
    """The memory-based transitions of one node's sandboxes (see the module docstring)."""

    def __init__(
        self,
        config: NodeConfig,
        pool: BtrfsPool,
        store: StateStore,
        snapshots: SnapshotStore,
        on_vm_exit: Callable[[LiveSandbox], None],
    ) -> None:
        self.config = config
        self.pool = pool
        self.store = store
        self.snapshots = snapshots
        self.on_vm_exit = on_vm_exit

    def save(
        self, sandbox: LiveSandbox, state: SandboxState, *, pending: Pending | None = None
    ) -> None:
        self.store.save(sandbox.mark(state, pending=pending))

    # identity and clock

    async def apply_identity(self, sandbox: LiveSandbox, *, fresh: bool) -> None:
        """Set the guest's clock and reseed its RNG; ``fresh`` also renews hostname and
        machine-id. Needs the sandbox's channel open."""
        channel = sandbox.channel
        if channel is None:
            raise Unavailable("no guest channel", sandbox_id=sandbox.sandbox_id)
        await channel.set_identity(
            hostname=hostname_for(sandbox.sandbox_id) if fresh else None,
            machine_id=secrets.token_hex(16) if fresh else None,
            entropy=os.urandom(_ENTROPY_BYTES),
            time_ns=time.time_ns(),
        )

    async def settle_identity(self, sandbox: LiveSandbox) -> None:
        """Apply a pending identity (the VM runs restored memory), then clear it."""
        pending = sandbox.record.pending
        if pending is None or pending.op != "identity":
            return
        await self.apply_identity(sandbox, fresh=pending.fresh)
        sandbox.state_file.unlink(missing_ok=True)
        self.save(sandbox, SandboxState.RUNNING)

    async def sync_clock(self, sandbox: LiveSandbox) -> None:
        """Set the guest clock to the host's after its vCPUs stood still; best effort."""
        try:
            if sandbox.channel is None or sandbox.channel.closed:
                await sandbox.connect(hello_timeout_s=self.config.boot_timeout_s)
            assert sandbox.channel is not None
            await sandbox.channel.set_identity(time_ns=time.time_ns())
        except NodeError as exc:
            log.warning("sandbox %s: clock not synced: %s", sandbox.sandbox_id, exc)

    # waking saved memory

    async def start_from_memory(
        self, sandbox: LiveSandbox, *, fresh: bool, image: Path | None = None
    ) -> None:
        """Run the memory image in the sandbox's volume (a clone of ``image``, if
        given); returns with state RUNNING.

        Until the vCPUs run, a failure stops QEMU and leaves record and volume as they
        were (a hibernated sandbox stays hibernated). Once they run, the image is spent:
        the record says RUNNING with a pending identity before that moment, and a later
        failure (no hello) leaves the VM running for a retry to settle.
        """
        if sandbox.record.guest == "gvisor":
            await self._restore_gvisor(sandbox, fresh=fresh)
            return
        prior = sandbox.record.state
        vm = await sandbox.launch(
            qemu_binary=self.config.qemu_binary,
            incoming=True,
            memory_file=await asyncio.to_thread(ram_file, sandbox.volume, image),
        )
        try:
            await vm.load_state(sandbox.state_file)
            self.save(
                sandbox, SandboxState.RUNNING, pending=Pending("identity", prior, fresh=fresh)
            )
        except BaseException:
            await asyncio.shield(sandbox.teardown())
            raise
        await vm.resume()
        sandbox.watch(self.on_vm_exit, self.config.console_max_bytes)
        await sandbox.connect(hello_timeout_s=self.config.boot_timeout_s)
        await self.settle_identity(sandbox)

    async def _restore_gvisor(self, sandbox: LiveSandbox, *, fresh: bool) -> None:
        """``start_from_memory`` for a gVisor sandbox: ``runsc restore`` loads and runs
        in one step, on a new channel to the same spaced. A failure leaves nothing
        running, and the record and volume as they were."""
        prior = sandbox.record.state
        await sandbox.restore_gvisor(
            run_root=self.config.effective_run_dir, state=sandbox.state_file
        )
        self.save(sandbox, SandboxState.RUNNING, pending=Pending("identity", prior, fresh=fresh))
        sandbox.watch(self.on_vm_exit, self.config.console_max_bytes)
        await sandbox.connect(hello_timeout_s=self.config.boot_timeout_s)
        await self.settle_identity(sandbox)

    # hibernate

    async def hibernate(self, sandbox: LiveSandbox) -> None:
        """RUNNING or PAUSED -> HIBERNATED: memory to the volume, QEMU gone.

        On failure the VM goes back to its prior state and the error is raised.
        """
        prior = sandbox.record.state
        self.save(sandbox, prior, pending=Pending("hibernate", prior))
        try:
            await sandbox.save_state()
        except BaseException:
            await asyncio.shield(self.thaw(sandbox, prior))
            raise
        # Durable before QEMU goes: a crash now finds HIBERNATED and kills the stray VM.
        sandbox.record = replace(
            sandbox.record, state=SandboxState.HIBERNATED, vmm_pid=None, pending=None
        )
        self.store.save(sandbox.record)
        await sandbox.teardown()

    async def wake(self, sandbox: LiveSandbox) -> None:
        """HIBERNATED -> RUNNING, processes carrying on; the clock is set, RNG reseeded."""
        await self.start_from_memory(sandbox, fresh=False)

    # snapshots

    async def snapshot(self, sandbox: LiveSandbox, snapshot_id: str) -> SnapshotInfo:
        """Publish a read-only snapshot of the sandbox's disk and memory.

        The sandbox keeps its state (RUNNING, PAUSED or HIBERNATED). The snapshot is
        listed (its record written) only after its subvolume is durable.
        """
        prior = sandbox.record.state
        self.save(sandbox, prior, pending=Pending("snapshot", prior, snapshot_id))
        async with self.frozen(sandbox, prior):
            path = await self.pool.snapshot_volume(sandbox.record.volume, snapshot_id)
            spec = sandbox.record.spec
            info = SnapshotInfo(
                snapshot_id=snapshot_id,
                sandbox_id=sandbox.sandbox_id,
                parent_id=sandbox.record.head_snapshot,
                created_at=time.time(),
                template=spec.template,
                cpus=spec.cpus,
                memory_mib=spec.memory_mib,
                disk_mib=spec.disk_mib,
                memory_bytes=await asyncio.to_thread(memory_bytes, path),
                guest=sandbox.record.guest,
            )
            self.snapshots.save(info)
            sandbox.record = replace(sandbox.record, head_snapshot=snapshot_id)
        return info

    @contextlib.asynccontextmanager
    async def frozen(self, sandbox: LiveSandbox, prior: SandboxState) -> AsyncIterator[None]:
        """The sandbox's volume as a complete memory image for the body's duration.

        A live VM is paused and its state saved into the volume; afterwards the state
        file goes and the VM returns to ``prior``, whether the body failed or not. A
        hibernated sandbox's volume is an image already. Clears the pending operation.
        """
        live = prior != SandboxState.HIBERNATED
        if live:
            await preflush(sandbox.volume)
            try:
                await sandbox.save_state()
            except BaseException:
                await asyncio.shield(self.thaw(sandbox, prior))
                raise
        try:
            yield
        finally:
            await asyncio.shield(self._back_to(sandbox, prior))

    async def thaw(self, sandbox: LiveSandbox, prior: SandboxState) -> None:
        """Bring a VM paused for a state save back to ``prior``; drop the state file.

        A PAUSED sandbox runs for an instant: after a save QEMU is in ``postmigrate``,
        from which it cannot save again, and ``cont`` + ``stop`` leaves that state.
        """
        sandbox.state_file.unlink(missing_ok=True)
        try:
            await sandbox.resume()
            if prior == SandboxState.PAUSED:
                await sandbox.pause()
        except NodeError as exc:
            log.error("sandbox %s: cannot resume after a state save: %s", sandbox.sandbox_id, exc)
            self.save(sandbox, SandboxState.ERROR)
            return
        self.save(sandbox, prior)
        if prior == SandboxState.RUNNING:
            await self.sync_clock(sandbox)

    async def restore(self, sandbox: LiveSandbox, snapshot: SnapshotInfo) -> None:
        """Roll the sandbox back to ``snapshot`` in place; RUNNING with a fresh identity.

        A failure after the old VM is gone leaves the sandbox in ERROR (restore again).
        """
        prior = sandbox.record.state
        self.save(sandbox, prior, pending=Pending("restore", prior, snapshot.snapshot_id))
        await sandbox.teardown()
        try:
            await self.pool.clone_volume(
                self.pool.snapshot_path(snapshot.snapshot_id),
                sandbox.record.volume,
                limit_mib=_volume_limit(sandbox),
            )
            sandbox.record = replace(sandbox.record, head_snapshot=snapshot.snapshot_id)
            await self.start_from_memory(sandbox, fresh=True)
        except BaseException as exc:
            if sandbox.record.state != SandboxState.RUNNING:
                error = f"restore failed: {exc}"
                self.store.save(sandbox.mark(SandboxState.ERROR, error=error))
            raise

    async def create_from_image(
        self, sandbox: LiveSandbox, image: Path, *, head: str | None = None
    ) -> None:
        """Make a new sandbox's volume a copy of ``image`` (a snapshot, or a template's
        ready state) and run it with a fresh identity; ``head`` is its snapshot parent."""
        self.save(sandbox, SandboxState.CREATING, pending=Pending("fork", SandboxState.CREATING))
        await self.pool.clone_volume(image, sandbox.record.volume, limit_mib=_volume_limit(sandbox))
        sandbox.record = replace(sandbox.record, head_snapshot=head)
        await self.start_from_memory(sandbox, fresh=True, image=image)

    async def capture_image(self, sandbox: LiveSandbox, image: Path) -> None:
        """Save a RUNNING sandbox, whose RAM is a shared mapping of its volume's RAM
        file, as the image at ``image`` (a template's ready state); the sandbox is left
        paused, to be deleted.

        The image is a writable subvolume that nothing writes: QEMU 7.2 opens a RAM file
        read-write even to map it private, and a read-only subvolume refuses that.
        """
        await preflush(sandbox.volume)
        await sandbox.save_state()
        await asyncio.to_thread(fsync_file, sandbox.volume / MEMORY_FILE)
        await snapshot_subvolume(sandbox.volume, image)

    async def fork(self, parent: LiveSandbox, children: list[LiveSandbox]) -> None:
        """Start each child from a copy of the parent's disk and memory, taken now.

        The parent is paused for one state save and N subvolume snapshots, then runs
        on while the children start. Raises the first failure; the caller removes the
        children.
        """
        creating = Pending("fork", SandboxState.CREATING)
        for child in children:
            self.save(child, SandboxState.CREATING, pending=creating)
        prior = parent.record.state
        self.save(parent, prior, pending=Pending("capture", prior))
        thawed = False
        try:
            if prior != SandboxState.HIBERNATED:
                await preflush(parent.volume)
                await parent.save_state()
            for child in children:
                await self.pool.clone_volume(
                    parent.volume, child.record.volume, limit_mib=_volume_limit(child)
                )
            thawed = True
            results = await asyncio.gather(
                self._back_to(parent, prior),
                *(self.start_from_memory(child, fresh=True) for child in children),
                return_exceptions=True,
            )
        finally:
            if not thawed:
                await asyncio.shield(self._back_to(parent, prior))
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _back_to(self, sandbox: LiveSandbox, prior: SandboxState) -> None:
        """End a state save: a live VM returns to ``prior``, a hibernated one's record
        loses its pending operation."""
        if prior == SandboxState.HIBERNATED:
            self.save(sandbox, prior)
        else:
            await self.thaw(sandbox, prior)
