"""The snapshots of a node's sandboxes: take, list, measure and delete them.

Restore and fork, which start VMs, are the sandboxes' (space.node.agent._sandboxes),
which find their snapshots here. Every method raises space.node.api errors only.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from space.node.agent._registry import Registry
from space.node.api import Conflict, NotFound, SandboxSpec, SandboxState, SnapshotInfo
from space.node.core.sandbox import check_memory_ops, not_allowed, settled
from space.node.core.validation import check_compatible, check_id

__all__ = ["SAVEABLE", "Snapshots"]

#: States from which a sandbox's memory can be saved (hibernate, snapshot, fork).
SAVEABLE = (SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.HIBERNATED)


class Snapshots:
    """Snapshots of the node's sandboxes: read-only copies of disk and memory."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._pool = registry.pool
        self._records = registry.snapshots

    async def snapshot_sandbox(self, sandbox_id: str, snapshot_id: str) -> SnapshotInfo:
        """Take a read-only snapshot of a sandbox's disk and memory; returns it.

        The sandbox (RUNNING, PAUSED or HIBERNATED) keeps its state after a pause of
        one state save and one subvolume snapshot. Idempotent per ``snapshot_id`` (the
        same sandbox gets the published snapshot back; another sandbox, Conflict).
        Raises NotFound, Conflict naming the state, Unavailable/Timeout. Nothing of a
        failed or cancelled snapshot is ever listed.
        """
        check_id(snapshot_id, "snapshot id")
        async with self._registry.lock(sandbox_id):
            sandbox = self._registry.get(sandbox_id)
            existing = self._records.get(snapshot_id)
            if existing is not None:
                if existing.sandbox_id != sandbox_id:
                    raise Conflict(
                        f"snapshot {snapshot_id} is of another sandbox", sandbox_id=sandbox_id
                    )
                return existing
            check_memory_ops("snapshot", sandbox)
            if sandbox.record.state not in SAVEABLE:
                raise not_allowed("snapshot", sandbox)
            return await settled(self._registry.life.snapshot(sandbox, snapshot_id))

    async def list_snapshots(self) -> list[SnapshotInfo]:
        """Every published snapshot, oldest first, with ``exclusive_bytes`` measured."""
        infos = sorted(self._records.load_all()[0], key=lambda i: i.created_at)
        return list(await asyncio.gather(*(self._measured(i) for i in infos)))

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        check_id(snapshot_id, "snapshot id")
        return await self._measured(self.find(snapshot_id))

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Unpublish, then delete a snapshot; idempotent. Its children in the tree and
        sandboxes whose head it was get its parent instead."""
        check_id(snapshot_id, "snapshot id")
        async with self._registry.lock(f"snapshot/{snapshot_id}"):
            info = self._records.get(snapshot_id)
            if info is not None:
                for child in self._records.load_all()[0]:
                    if child.parent_id == snapshot_id:
                        self._records.save(replace(child, parent_id=info.parent_id))
                for sandbox in self._registry.sandboxes.values():
                    if sandbox.record.head_snapshot == snapshot_id:
                        sandbox.record = replace(sandbox.record, head_snapshot=info.parent_id)
                        self._registry.store.save(sandbox.record)
                self._records.remove(snapshot_id)
            await self._pool.delete_snapshot(snapshot_id)

    def find(self, snapshot_id: str) -> SnapshotInfo:
        """A published snapshot; NotFound if there is none of this id."""
        info = self._records.get(snapshot_id)
        if info is None:
            raise NotFound(f"no snapshot {snapshot_id!r} on this node")
        return info

    def compatible(self, spec: SandboxSpec) -> SnapshotInfo:
        """The snapshot ``spec`` is made from, checked against the spec's resources."""
        snapshot = self.find(check_id(spec.from_snapshot, "snapshot id"))
        check_compatible(spec, snapshot)
        return snapshot

    async def _measured(self, info: SnapshotInfo) -> SnapshotInfo:
        path = self._pool.snapshot_path(info.snapshot_id)
        return replace(info, exclusive_bytes=await self._pool.exclusive_bytes(path))
