"""Snapshots and hibernated sandboxes kept in the artifact store (issue 19), so that a
snapshot restores on any node and a hibernated sandbox outlives its node.

Each is a bundle (space.node.artifacts): its subvolume as a full btrfs send stream
(part ``volume``) and what describes it (part ``info``), the manifest last, so a
bundle is restorable only once every part landed. A full stream, not one against a
template: any node of the cluster can receive it, whatever templates it holds.

- a snapshot is ``snapshots/<snapshot id>``: immutable, so one name forever;
  ``fetch_snapshot`` makes a node that lacks it a copy from the store (then listed
  there like its own);
- a hibernated sandbox is ``sandboxes/<sandbox id>/<token>``, a new name per upload.
  The sandbox's record names it (``archive``) only while the sandbox is the one that
  was uploaded: any change of state clears it (SandboxRecord.with_state), and an upload
  finished after such a change is deleted, never named. ``import_archive`` registers
  the sandbox here, HIBERNATED, from its bundle, still naming it (its content is the
  bundle's until it wakes).

The node never deletes a sandbox's bundle of its own accord: the control plane, which
knows which one is current, asks (``delete_archive``). Disks and saved memory are
sealed with the node key, as they are on the node: only a node with the same key
(``key_id``) restores them, and the bundle's info says which key that is. The store
seals every object again under the cluster's artifact master key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from pathlib import Path

from space.node.agent._moves import (
    check_runs_here,
    clear_staging,
    install_received,
    new_staging,
    portable_record,
    record_from,
    stream_bound,
)
from space.node.agent._registry import Registry
from space.node.api import (
    Conflict,
    ImportResult,
    InvalidArgument,
    NotFound,
    SandboxState,
    SandboxStatus,
    SnapshotInfo,
    Unavailable,
    decode,
    encode,
    snapshot_archive,
)
from space.node.artifacts import SealedStore, delete_bundle, get_bundle, put_bundle
from space.node.artifacts._bundles import Bundle
from space.node.core.capacity import Claim
from space.node.core.sandbox import not_allowed
from space.node.core.validation import check_id
from space.node.storage.btrfs import snapshot_subvolume
from space.node.storage.streams import Received, adopt_received, receive_stream, send_stream

__all__ = ["Archives", "check_archive_name"]

#: An info part is a record or a SnapshotInfo and a key id: a few KiB.
_MAX_INFO_BYTES = 64 << 10
_ARCHIVE = re.compile(r"(snapshots/sn-[0-9a-f]{24}|sandboxes/[A-Za-z0-9_.-]{1,64}/[0-9a-f]{16})")


def check_archive_name(name: str) -> str:
    """``name`` if it is a bundle this module makes; else InvalidArgument."""
    if not isinstance(name, str) or not _ARCHIVE.fullmatch(name):
        raise InvalidArgument(f"{name!r} is not an archive's name")
    return name


class Archives:
    """The node's side of the artifact store (see the module docstring)."""

    def __init__(self, registry: Registry, store: SealedStore | None, key_id: str) -> None:
        self._registry = registry
        self._store = store
        self._key_id = key_id

    @property
    def enabled(self) -> bool:
        return self._store is not None

    def _the_store(self) -> SealedStore:
        if self._store is None:
            raise Unavailable("this node has no artifact store (--artifact-store)")
        return self._store

    # snapshots

    async def archive_snapshot(self, snapshot_id: str) -> None:
        """Keep the snapshot in the store; idempotent (a complete bundle is left as it
        is). Raises NotFound (no such snapshot here), Unavailable (no store, or it
        failed: a half-made bundle is deleted, or replaced by the next try)."""
        store = self._the_store()
        bundle = snapshot_archive(check_id(snapshot_id, "snapshot id"))
        # Its lock keeps it from being deleted under the upload.
        async with self._registry.lock(f"snapshot/{snapshot_id}"):
            info = self._registry.snapshots.get(snapshot_id)
            if info is None:
                raise NotFound(f"no snapshot {snapshot_id!r} on this node")
            if await _complete(store, bundle):
                return
            await delete_bundle(store, bundle)  # what an interrupted upload left
            path = self._registry.pool.snapshot_path(snapshot_id)
            document = {"key_id": self._key_id, "snapshot": encode(info)}
            await self._upload(store, bundle, document, path)

    async def fetch_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        """The snapshot, copied here from the store first if this node lacks it.
        Raises NotFound (in neither place, or not complete in the store), InvalidArgument
        (sealed with another node key, or a bundle that is not this snapshot's),
        Unavailable (no store, or it failed: nothing is left here)."""
        registry = self._registry
        check_id(snapshot_id, "snapshot id")
        async with registry.lock(f"snapshot/{snapshot_id}"):
            found = registry.snapshots.get(snapshot_id)
            if found is not None:
                return found
            store = self._the_store()
            bundle = await get_bundle(store, snapshot_archive(snapshot_id))
            document = await self._info(bundle)
            try:
                info = decode(SnapshotInfo, document.get("snapshot"))
            except ValueError as exc:
                raise InvalidArgument(f"the stored snapshot's info is malformed: {exc}") from None
            if info.snapshot_id != snapshot_id:
                raise InvalidArgument(f"the bundle of {snapshot_id} holds another snapshot")
            pool = registry.pool
            staging = await new_staging(registry.pool)
            try:
                received = await self._receive(bundle, staging, stream_bound(info))
                # Snapshots are read-only: received writable (to be the agent's), then
                # snapshotted read-only into place, the received copy deleted.
                await adopt_received(
                    pool.broker, received.path, writable=True, guest_tree=info.guest == "gvisor"
                )
                target = pool.snapshot_path(snapshot_id)
                await snapshot_subvolume(received.path, target, read_only=True)
            finally:
                await asyncio.shield(clear_staging(pool, staging))
            registry.snapshots.save(replace(info, exclusive_bytes=None))
            return info

    # hibernated sandboxes

    async def archive_sandbox(self, sandbox_id: str) -> SandboxStatus:
        """Keep the HIBERNATED sandbox in the store; its status then names the bundle
        (``archive``). Idempotent while it stays hibernated. Raises NotFound, Conflict
        (another state, or it changed while it was uploaded: that upload is deleted),
        Unavailable (no store, or it failed)."""
        store = self._the_store()
        registry = self._registry
        pool = registry.pool
        async with registry.lock(sandbox_id):
            sandbox = registry.get(sandbox_id)
            uploaded = sandbox.record
            if uploaded.archive is not None:
                return uploaded.status()
            if uploaded.state != SandboxState.HIBERNATED or uploaded.pending:
                raise not_allowed("archive", sandbox)
            frozen = await self._frozen(pool.sandbox_path(uploaded.volume), sandbox_id)
        bundle = f"sandboxes/{sandbox_id}/{secrets.token_hex(8)}"
        document = {"key_id": self._key_id, "record": portable_record(uploaded)}
        try:
            await self._upload(store, bundle, document, frozen)
        except BaseException:
            await asyncio.shield(_forget(store, bundle))
            raise
        finally:
            await asyncio.shield(pool.delete_staged(frozen))
        async with registry.lock(sandbox_id):
            now = registry.sandboxes.get(sandbox_id)
            # The record is replaced by every change: the same object is the same sandbox.
            if now is None or now.record is not uploaded:
                await asyncio.shield(_forget(store, bundle))
                raise Conflict("the sandbox changed while it was archived", sandbox_id=sandbox_id)
            now.record = replace(uploaded, archive=bundle)
            registry.store.save(now.record)
            return now.record.status()

    async def import_archive(self, sandbox_id: str, archive: str) -> ImportResult:
        """Register the sandbox here, HIBERNATED, from its bundle ``archive`` (it keeps
        naming it). Raises NotFound (no complete bundle), InvalidArgument (another
        node key, another sandbox's bundle, a malformed record or stream), Conflict
        (the id is in use here), InsufficientCapacity (no room for it here, as for a
        create of its size), Unavailable. Nothing of a failed import is left here."""
        check_id(sandbox_id)
        if not check_archive_name(archive).startswith(f"sandboxes/{sandbox_id}/"):
            raise InvalidArgument(f"{archive} is not an archive of {sandbox_id}")
        store = self._the_store()
        bundle = await get_bundle(store, archive)
        document = await self._info(bundle)
        record = record_from(document.get("record"), sandbox_id)
        registry = self._registry
        check_runs_here(registry, record)
        record = replace(record, run_dir=str(registry.run_root / sandbox_id), archive=archive)
        async with registry.lock(sandbox_id):
            if sandbox_id in registry.sandboxes:
                raise Conflict(f"sandbox {sandbox_id} exists on this node", sandbox_id=sandbox_id)
            # Admitted as a move is (space.node.agent._moves), before a byte is read.
            claim = Claim.sandbox(record.spec.memory_mib, record.spec.disk_mib)
            with registry.admission.claim({sandbox_id: claim}, sandbox_id=sandbox_id):
                staging = await new_staging(registry.pool)
                try:
                    received = await self._receive(bundle, staging, stream_bound(record.spec))
                    await install_received(registry, record, received.path)
                finally:
                    await asyncio.shield(clear_staging(registry.pool, staging))
            status = registry.sandboxes[sandbox_id].record.status()
            return ImportResult(status, received.stream_bytes, None)

    async def delete_archive(self, name: str) -> None:
        """Delete a bundle this module made; idempotent."""
        await delete_bundle(self._the_store(), check_archive_name(name))

    # the parts

    async def _upload(
        self, store: SealedStore, bundle: str, document: Mapping[str, object], volume: Path
    ) -> None:
        async def info() -> AsyncIterator[bytes]:
            yield json.dumps(document).encode()

        parts = [
            ("info", info()),
            ("volume", send_stream(self._registry.pool.broker, volume, None)),
        ]
        await put_bundle(store, bundle, parts)

    async def _info(self, bundle: Bundle) -> dict[str, object]:
        data = bytearray()
        async with contextlib.aclosing(bundle.part("info")) as pieces:
            async for piece in pieces:
                data += piece
                if len(data) > _MAX_INFO_BYTES:
                    raise InvalidArgument(f"bundle {bundle.manifest.bundle}'s info is too large")
        try:
            document = json.loads(data)
        except ValueError:
            document = None
        if not isinstance(document, dict):
            raise InvalidArgument(f"bundle {bundle.manifest.bundle}'s info is not an object")
        if document.get("key_id") != self._key_id:
            raise InvalidArgument(
                f"bundle {bundle.manifest.bundle} is sealed with another node key"
            )
        return document

    async def _receive(self, bundle: Bundle, staging: Path, max_bytes: int) -> Received:
        """Receive the bundle's volume. A refused stream is read on to its end, which
        checks it against the manifest: ChecksumMismatch if what came is not what was
        stored (the read went wrong), else the refusal, saying that the read was not
        to blame (nor the sender, when this node found it well-framed: the pipe)."""
        pool = self._registry.pool
        async with contextlib.aclosing(bundle.part("volume")) as chunks:
            try:
                return await receive_stream(
                    pool.broker, pool.root, staging, chunks, max_bytes=max_bytes
                )
            except InvalidArgument as refused:
                async for _ in chunks:
                    pass
                raise InvalidArgument(
                    f"{refused.message} (bundle {bundle.manifest.bundle}: what was read"
                    " matches its manifest)"
                ) from None

    async def _frozen(self, volume: Path, sandbox_id: str) -> Path:
        """A read-only snapshot of ``volume`` to stream from, in the pool's exports."""
        exports = self._registry.pool.root / "exports"
        await asyncio.to_thread(exports.mkdir, 0o700, exist_ok=True)
        frozen = exports / f"{sandbox_id}.{secrets.token_hex(4)}"
        await snapshot_subvolume(volume, frozen, read_only=True)
        return frozen


async def _complete(store: SealedStore, bundle: str) -> bool:
    try:
        await get_bundle(store, bundle)
    except NotFound:
        return False
    return True


async def _forget(store: SealedStore, bundle: str) -> None:
    with contextlib.suppress(Exception):
        await delete_bundle(store, bundle)
