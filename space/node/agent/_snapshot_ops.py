"""The snapshot operations of a node: take, list, measure and delete snapshots.

Private to space.node.agent.node: ``Node`` inherits them (restore and fork, which start
VMs, stay in the service). Every method raises space.node.api.errors leaves only.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import replace

from space.node.agent._lifecycle import Lifecycle
from space.node.api import Conflict, NotFound, SandboxSpec, SandboxState, SnapshotInfo
from space.node.core.sandbox import LiveSandbox, not_allowed, settled
from space.node.core.state import SnapshotStore, StateStore
from space.node.core.validation import check_compatible, check_id
from space.node.storage.btrfs import BtrfsPool

__all__ = ["SAVEABLE", "SnapshotOps"]

#: States from which a sandbox's memory can be saved (hibernate, snapshot, fork).
SAVEABLE = (SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.HIBERNATED)


class SnapshotOps(ABC):
    """Snapshots of the node's sandboxes: read-only copies of disk and memory."""

    pool: BtrfsPool
    _life: Lifecycle
    _store: StateStore
    _snapshots: SnapshotStore
    _sandboxes: dict[str, LiveSandbox]

    @abstractmethod
    def _lock(self, sandbox_id: str) -> asyncio.Lock: ...

    @abstractmethod
    def _get(self, sandbox_id: str) -> LiveSandbox: ...

    async def snapshot_sandbox(self, sandbox_id: str, snapshot_id: str) -> SnapshotInfo:
        """Take a read-only snapshot of a sandbox's disk and memory; returns it.

        The sandbox (RUNNING, PAUSED or HIBERNATED) keeps its state after a pause of
        one state save and one subvolume snapshot. Idempotent per ``snapshot_id`` (the
        same sandbox gets the published snapshot back; another sandbox, Conflict).
        Raises NotFound, Conflict naming the state, Unavailable/Timeout. Nothing of a
        failed or cancelled snapshot is ever listed.
        """
        check_id(snapshot_id, "snapshot id")
        async with self._lock(sandbox_id):
            sandbox = self._get(sandbox_id)
            existing = self._snapshots.get(snapshot_id)
            if existing is not None:
                if existing.sandbox_id != sandbox_id:
                    raise Conflict(
                        f"snapshot {snapshot_id} is of another sandbox", sandbox_id=sandbox_id
                    )
                return existing
            if sandbox.record.state not in SAVEABLE:
                raise not_allowed("snapshot", sandbox)
            return await settled(self._life.snapshot(sandbox, snapshot_id))

    async def list_snapshots(self) -> list[SnapshotInfo]:
        """Every published snapshot, oldest first, with ``exclusive_bytes`` measured."""
        infos = sorted(self._snapshots.load_all()[0], key=lambda i: i.created_at)
        return list(await asyncio.gather(*(self._measured(i) for i in infos)))

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        check_id(snapshot_id, "snapshot id")
        return await self._measured(self._snapshot(snapshot_id))

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Unpublish, then delete a snapshot; idempotent. Its children in the tree and
        sandboxes whose head it was get its parent instead."""
        check_id(snapshot_id, "snapshot id")
        async with self._lock(f"snapshot/{snapshot_id}"):
            info = self._snapshots.get(snapshot_id)
            if info is not None:
                for child in self._snapshots.load_all()[0]:
                    if child.parent_id == snapshot_id:
                        self._snapshots.save(replace(child, parent_id=info.parent_id))
                for sandbox in self._sandboxes.values():
                    if sandbox.record.head_snapshot == snapshot_id:
                        sandbox.record = replace(sandbox.record, head_snapshot=info.parent_id)
                        self._store.save(sandbox.record)
                self._snapshots.remove(snapshot_id)
            await self.pool.delete_snapshot(snapshot_id)

    def _snapshot(self, snapshot_id: str) -> SnapshotInfo:
        info = self._snapshots.get(snapshot_id)
        if info is None:
            raise NotFound(f"no snapshot {snapshot_id!r} on this node")
        return info

    def _compatible_snapshot(self, spec: SandboxSpec) -> SnapshotInfo:
        snapshot = self._snapshot(check_id(spec.from_snapshot, "snapshot id"))
        check_compatible(spec, snapshot)
        return snapshot

    async def _measured(self, info: SnapshotInfo) -> SnapshotInfo:
        path = self.pool.snapshot_path(info.snapshot_id)
        return replace(info, exclusive_bytes=await self.pool.exclusive_bytes(path))
