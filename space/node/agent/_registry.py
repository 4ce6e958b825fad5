"""The registry every service of the node agent shares: the live sandboxes and how to
make and unmake one.

``Node`` makes one ``Registry`` and hands it to each of its services (space.node.agent);
recovery, builds, ready states and warm pools get it too. It holds the node's stores,
its btrfs pool, its template catalog, the per-id locks, the bound on VMs starting at
once and the admission every VM start asks first (space.node.agent._admission); nothing
in it is specific to one service.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import weakref
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from space.node.agent._admission import Admission
from space.node.agent._build_network import BuildNetwork
from space.node.agent._catalog import Catalog
from space.node.agent._egress import SandboxNetwork
from space.node.agent._lifecycle import Lifecycle
from space.node.api import EgressPolicy, NodeError, NotFound, SandboxState
from space.node.core.capacity import Resident, measure_host
from space.node.core.config import NodeConfig
from space.node.core.keys import NodeKeys
from space.node.core.sandbox import LiveSandbox, vm_config_for
from space.node.core.state import SandboxRecord, SnapshotStore, StateStore
from space.node.storage.btrfs import BtrfsPool
from space.node.vmm.accel import Accelerator
from space.node.vmm.gvisor import runsc_available, stop_by_name

__all__ = ["Registry"]

log = logging.getLogger(__name__)


class Registry:
    """The node's live sandboxes, their locks and stores, and how to make and unmake one."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        pool: BtrfsPool,
        catalog: Catalog,
        accel: Accelerator,
        network: SandboxNetwork,
        keys: NodeKeys,
    ) -> None:
        self.config = config
        self.keys = keys
        self.pool = pool
        self.catalog = catalog
        self.accelerator = accel
        self.network = network
        #: The guest types this node runs: QEMU always, gVisor where runsc is installed.
        self.guest_types = ["qemu", "gvisor"] if runsc_available() else ["qemu"]
        self.run_root = config.effective_run_dir
        self.store = StateStore(config.data_dir / "sandboxes")
        self.snapshots = SnapshotStore(config.data_dir / "snapshots")
        self.life = Lifecycle(config, pool, self.store, self.snapshots, self.on_vm_exit)
        #: The node's sandboxes by id (the node's own VMs too while they run).
        self.sandboxes: dict[str, LiveSandbox] = {}
        # Per-id locks that outlive a sandbox only while someone waits on them.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._tasks: set[asyncio.Task[None]] = set()
        # A hundred QEMUs starting at once on a small host time out on their sockets;
        # creates past the bound wait their turn instead. A pool hit starts none.
        self.starts = asyncio.Semaphore(config.max_parallel_starts)
        self.admission = Admission(
            config.capacity,
            residents=self._residents,
            measure=lambda: measure_host(pool.root),
        )

    def _residents(self) -> dict[str, Resident]:
        return {
            sid: Resident(sandbox.record.state, sandbox.record.spec.memory_mib)
            for sid, sandbox in self.sandboxes.items()
        }

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        """The sandbox's lock (or the one of an id not in use yet, e.g. ``snapshot/<id>``)."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is not None:
            return sandbox.lock
        lock = self._locks.get(sandbox_id)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[sandbox_id] = lock
        return lock

    def get(self, sandbox_id: str) -> LiveSandbox:
        """The live sandbox; NotFound if the node has none of this id."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            raise NotFound(f"no sandbox {sandbox_id!r} on this node", sandbox_id=sandbox_id)
        return sandbox

    def live(self, record: SandboxRecord, lock: asyncio.Lock | None = None) -> LiveSandbox:
        """A live sandbox of ``record`` (no VM yet), not registered."""
        sid = record.sandbox_id
        config = vm_config_for(
            record,
            volume=self.pool.sandbox_path(record.volume),
            # Every template boots the base image's kernel with its command line.
            base_cmdline=self.catalog.base.kernel_cmdline,
            accel=self.accelerator,
            console_log=self.console_log(sid),
            keys=self.keys,
        )
        return LiveSandbox(record=record, config=config, lock=lock or self.lock(sid))

    async def destroy(self, sandbox: LiveSandbox) -> None:
        """Take a sandbox apart completely; logs (never raises) what it cannot remove."""
        sid = sandbox.sandbox_id
        try:
            await sandbox.teardown()
        except NodeError as exc:
            log.error("sandbox %s: stopping its VM failed: %s", sid, exc)
        if sandbox.record.guest == "gvisor":
            # Whether or not this process started it (a restarted node's is unknown).
            await stop_by_name(self.run_root, Path(sandbox.record.run_dir).name)
        await self.network.drop(sid, Path(sandbox.record.run_dir))
        await self.remove_leftovers(sid, volume=sandbox.record.volume)
        shutil.rmtree(sandbox.record.run_dir, ignore_errors=True)  # a pool VM's keeps its name
        self.sandboxes.pop(sid, None)
        self.admission.release(sid)

    async def remove_leftovers(self, sandbox_id: str, *, volume: str | None = None) -> None:
        """Remove volume (``volume``, else the one named after the id), run dir, console
        logs and state of a sandbox whose VM is gone."""
        try:
            await self.pool.delete_sandbox_volume(volume or sandbox_id)
        except NodeError as exc:
            log.error("sandbox %s: deleting its volume failed: %s", sandbox_id, exc)
        await self.network.drop(sandbox_id, self.run_root / sandbox_id)
        shutil.rmtree(self.run_root / sandbox_id, ignore_errors=True)
        console = self.console_log(sandbox_id)
        for path in (console, console.with_suffix(".old")):
            path.unlink(missing_ok=True)
        self.store.remove(sandbox_id)

    def build_network(
        self, vm: LiveSandbox, policy: EgressPolicy
    ) -> AbstractAsyncContextManager[BuildNetwork]:
        """The network of a build VM, as its template's ``build_egress`` allows."""
        return self.network.for_build(vm, policy)

    def console_log(self, sandbox_id: str) -> Path:
        return self.store.directory / f"{sandbox_id}.console.log"

    def on_vm_exit(self, sandbox: LiveSandbox) -> None:
        """QEMU exited without being asked (or was stopped because its guest abused the
        channel, ``fault``): the sandbox goes to ERROR (kept for inspection)."""
        if sandbox.fault is not None:
            error = sandbox.fault  # logged when the VM was stopped
        else:
            tail = sandbox.console_tail()
            log.warning(
                "sandbox %s: qemu exited unexpectedly; console tail:\n%s", sandbox.sandbox_id, tail
            )
            error = f"VM exited unexpectedly; console tail: {tail[-500:]}"
        self.store.save(sandbox.mark(SandboxState.ERROR, error=error))
        task = asyncio.get_running_loop().create_task(sandbox.disconnect())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
