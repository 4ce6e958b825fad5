"""The archives half of the fake node (issue 19): an artifact store in memory, shared by
the fake nodes that are given the same ``FakeArchiveStore``."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from space.node.api import (
    Conflict,
    ImportResult,
    NotFound,
    SandboxState,
    SandboxStatus,
    SnapshotInfo,
    Unavailable,
    snapshot_archive,
)


@dataclass
class FakeArchiveStore:
    """Bundles by name: a sandbox's box or a snapshot, as uploaded."""

    objects: dict[str, Any] = field(default_factory=dict)


class FakeArchives:
    """The NodeService's archive methods over ``archive_store`` (None: the node has no
    store, and they raise Unavailable as the real node does)."""

    boxes: dict[str, Any]
    snapshots: dict[str, Any]
    calls: list[tuple[str, str]]

    def __init__(self, store: FakeArchiveStore | None = None) -> None:
        self.archive_store = store

    def _store(self) -> FakeArchiveStore:
        if self.archive_store is None:
            raise Unavailable("this node has no artifact store")
        return self.archive_store

    async def archive_snapshot(self, snapshot_id: str) -> None:
        self.calls.append(("archive_snapshot", snapshot_id))
        store = self._store()
        snap = self.snapshots.get(snapshot_id)
        if snap is None:
            raise NotFound(f"no snapshot {snapshot_id!r} on this node")
        store.objects[snapshot_archive(snapshot_id)] = replace(
            snap, contents=snap.contents.copy(snap.contents.status)
        )

    async def fetch_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        self.calls.append(("fetch_snapshot", snapshot_id))
        if snapshot_id in self.snapshots:
            return self.snapshots[snapshot_id].info  # type: ignore[no-any-return]
        stored = self._store().objects.get(snapshot_archive(snapshot_id))
        if stored is None:
            raise NotFound(f"bundle snapshots/{snapshot_id} has no manifest: not restorable")
        self.snapshots[snapshot_id] = replace(
            stored, contents=stored.contents.copy(stored.contents.status)
        )
        return stored.info  # type: ignore[no-any-return]

    async def archive_sandbox(self, sandbox_id: str) -> SandboxStatus:
        self.calls.append(("archive_sandbox", sandbox_id))
        store = self._store()
        box = self.boxes.get(sandbox_id)
        if box is None:
            raise NotFound(f"no sandbox {sandbox_id}", sandbox_id=sandbox_id)
        if box.status.archive is not None:
            return box.status  # type: ignore[no-any-return]
        if box.status.state != SandboxState.HIBERNATED:
            raise Conflict(f"cannot archive sandbox {sandbox_id}: it is {box.status.state.value}")
        name = f"sandboxes/{sandbox_id}/{secrets.token_hex(8)}"
        box.status = replace(box.status, archive=name)
        store.objects[name] = box.copy(box.status)
        return box.status  # type: ignore[no-any-return]

    async def import_archive(self, sandbox_id: str, archive: str) -> ImportResult:
        self.calls.append(("import_archive", sandbox_id))
        stored = self._store().objects.get(archive)
        if stored is None or not archive.startswith(f"sandboxes/{sandbox_id}/"):
            raise NotFound(f"bundle {archive} has no manifest: not restorable")
        if sandbox_id in self.boxes:
            raise Conflict(f"sandbox {sandbox_id} exists on this node", sandbox_id=sandbox_id)
        self.boxes[sandbox_id] = stored.copy(stored.status)
        return ImportResult(stored.status, 4096, None)

    async def delete_archive(self, name: str) -> None:
        self.calls.append(("delete_archive", name))
        self._store().objects.pop(name, None)
