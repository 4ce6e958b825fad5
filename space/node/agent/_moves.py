"""Moves of hibernated sandboxes between nodes (issue 19): the node's half of each end.

A move is pulled by the target. The source's ``export`` holds the hibernated sandbox
still and answers an ExportTicket; the target's ``import_`` asks the source's
``stream`` for the sandbox's volume as a btrfs send stream (incremental against a
template subvolume both nodes hold, by received UUID; full otherwise), over the node
API, presenting only the ticket; the source's ``finish`` then deletes its copy or
lets it go on. Why pull: the source never needs a credential of the target, the one
that must check and accept the bytes holds the call the control plane waits on (its
answer is the confirmation), and a source that fails mid-stream changes nothing.

The stream on the wire is framed: ``D`` + u32 length + bytes (a chunk of the send
stream), then ``E`` + the SHA-256 of the whole send stream + its u64 length. The
root broker hashes what it read and fed to btrfs receive, and the volume is accepted
only when that equals the sender's trailer; a bad,
short or cut stream leaves nothing on the target, and the source's sandbox is never
touched before ``finish``. The source streams from a read-only snapshot of the volume
(made for the stream, deleted after), so the sandbox's own volume is only read.

The target admits the sandbox as it would a create of its size (space.node.core.
capacity: a volume's room in the pool, one more sandbox under the cap, memory to wake
it) before it asks the source for anything, and holds that claim while the stream
comes; a full target refuses with InsufficientCapacity and the drain asks the next.

A hibernated sandbox's disk and saved memory are sealed with its node's key
(space.node.core.keys): only a node with the same key (``key_id``) can wake it, so
a target with another key refuses the ticket before any byte moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import secrets
import shutil
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from space.limits import RESOURCES
from space.node.agent._egress import parse_policy
from space.node.agent._registry import Registry
from space.node.api import (
    Conflict,
    ExportTicket,
    ImportResult,
    InvalidArgument,
    NodeError,
    PermissionDenied,
    SandboxSpec,
    SandboxState,
    SnapshotInfo,
)
from space.node.core.capacity import Claim, volume_limit_mib
from space.node.core.sandbox import check_memory_ops, check_not_held, not_allowed
from space.node.core.state import SandboxRecord
from space.node.core.validation import check_id
from space.node.storage.btrfs import BtrfsPool, snapshot_subvolume
from space.node.storage.streams import (
    STREAM_CHUNK_BYTES,
    SubvolumeIds,
    adopt_received,
    is_read_only_subvolume,
    receive_stream,
    send_stream,
    subvolume_ids,
)

__all__ = [
    "EXPORT_TTL_S",
    "STREAM_EXTRA_MIB",
    "STREAM_SLACK",
    "Moves",
    "Source",
    "clear_staging",
    "framed",
    "frames_of",
    "install_received",
    "new_staging",
    "portable_record",
    "record_from",
    "stream_bound",
]

#: How long an export holds its sandbox and its ticket is good for.
EXPORT_TTL_S = 600.0
_DATA, _END = b"D", b"E"
_LENGTH = struct.Struct(">I")
_TRAILER = struct.Struct(">32sQ")
#: What a stream may exceed the volume's own bound by: btrfs send's framing and
#: metadata (a few percent of the data; measured 0.1% for a 256 MiB guest).
STREAM_SLACK = 1.25
#: What a template's stream (a shipment, a build cache's layer) may take beyond its
#: disk: its kernel and initrd (about 60 MiB for Debian's cloud kernel) and btrfs send's
#: framing (a few percent).
STREAM_EXTRA_MIB = 512
_MIN_STREAM_BYTES = 64 << 20
_MAX_RECORD_KEYS = 32


class Source(Protocol):
    """The source node's API as the target reaches it (a RemoteNode holding the
    ticket as its credential)."""

    def stream_export(
        self, sandbox_id: str, ticket: str, parent: str | None
    ) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


@dataclass
class _Export:
    ticket: str
    expires_at: float
    #: The read-only subvolumes the stream may be against, by stream id.
    parents: dict[str, Path]


class Moves:
    """Both ends of a move on one node (see the module docstring)."""

    def __init__(
        self, registry: Registry, remote: Callable[[str, str], Source], key_id: str
    ) -> None:
        self._registry = registry
        self._remote = remote  # (source_url, ticket) -> the source's node API
        self._key_id = key_id
        self._exports: dict[str, _Export] = {}

    # the source

    async def export(self, sandbox_id: str) -> ExportTicket:
        """Hold the HIBERNATED sandbox still for a move and answer its ticket.

        Raises NotFound, Conflict (not hibernated, or held for a move already)."""
        check_id(sandbox_id)
        registry = self._registry
        async with registry.lock(sandbox_id):
            sandbox = registry.get(sandbox_id)
            check_memory_ops("move", sandbox)
            if sandbox.record.state != SandboxState.HIBERNATED or sandbox.record.pending:
                raise not_allowed("move", sandbox)
            check_not_held("export", sandbox)
            volume = registry.pool.sandbox_path(sandbox.record.volume)
            # A gVisor volume is a clone of this node's tree of its template, which no
            # other node holds as the same subvolume: its stream is full.
            parents = (
                {}
                if sandbox.record.guest == "gvisor"
                else await asyncio.to_thread(
                    _origins, registry.pool.root, volume, sandbox.record.template_digest
                )
            )
            ticket = secrets.token_urlsafe(32)
            expires_at = time.time() + EXPORT_TTL_S
            self._exports[sandbox_id] = _Export(ticket, expires_at, parents)
            sandbox.held_until = time.monotonic() + EXPORT_TTL_S
            return ExportTicket(
                sandbox_id=sandbox_id,
                ticket=ticket,
                expires_at=expires_at,
                record=portable_record(sandbox.record),
                parents=sorted(parents),
                key_id=self._key_id,
                max_stream_bytes=stream_bound(sandbox.record.spec),
            )

    def _export_of(self, sandbox_id: str, ticket: str) -> _Export:
        export = self._exports.get(sandbox_id)
        if export is None or not hmac.compare_digest(export.ticket, ticket):
            raise PermissionDenied("no such export ticket", sandbox_id=sandbox_id)
        if time.time() > export.expires_at:
            raise PermissionDenied("the export ticket has expired", sandbox_id=sandbox_id)
        return export

    async def stream(
        self, sandbox_id: str, ticket: str, parent: str | None
    ) -> AsyncIterator[bytes]:
        """The framed stream of an exported sandbox's volume (see the module
        docstring), against ``parent`` (one of the ticket's ``parents``; None: full).
        Raises PermissionDenied (ticket), InvalidArgument (parent) before the first
        frame; a failure later ends the stream without its trailer."""
        export = self._export_of(sandbox_id, ticket)
        parent_path = None if parent is None else export.parents.get(parent)
        if parent is not None and parent_path is None:
            raise InvalidArgument(f"{parent!r} is not a parent of this export")
        registry = self._registry
        sandbox = registry.get(sandbox_id)
        exports = registry.pool.root / "exports"
        await asyncio.to_thread(exports.mkdir, 0o700, exist_ok=True)
        frozen = exports / f"{sandbox_id}.{secrets.token_hex(4)}"
        await snapshot_subvolume(
            registry.pool.sandbox_path(sandbox.record.volume), frozen, read_only=True
        )
        try:
            frames = framed(send_stream(registry.pool.broker, frozen, parent_path))
            async with contextlib.aclosing(frames):
                async for frame in frames:
                    yield frame
        finally:
            await asyncio.shield(registry.pool.delete_staged(frozen))

    async def finish(self, sandbox_id: str, ticket: str, *, moved: bool) -> None:
        """End an export: ``moved`` deletes the sandbox here (the target has it), else
        it goes on here as it was. Raises PermissionDenied (ticket); idempotent once
        the sandbox is gone."""
        registry = self._registry
        async with registry.lock(sandbox_id):
            if sandbox_id not in registry.sandboxes and sandbox_id not in self._exports:
                return
            export = self._exports.get(sandbox_id)
            if export is None or not hmac.compare_digest(export.ticket, ticket):
                raise PermissionDenied("no such export ticket", sandbox_id=sandbox_id)
            del self._exports[sandbox_id]
            sandbox = registry.sandboxes.get(sandbox_id)
            if sandbox is None:
                return
            sandbox.held_until = None
            if moved:
                await asyncio.shield(registry.destroy(sandbox))

    async def sweep(self) -> None:
        """Delete what moves interrupted by a node restart left in the pool (streams'
        snapshots, half-received volumes); exports held in memory ended with it."""
        pool = self._registry.pool
        for kind in ("exports", "incoming"):
            directory = pool.root / kind
            entries = await asyncio.to_thread(_entries, directory)
            for entry in entries:
                with contextlib.suppress(NodeError):
                    if kind == "incoming":
                        await self._clear(entry)
                    else:
                        await pool.delete_staged(entry)

    # the target

    async def import_(self, ticket: ExportTicket, source_url: str) -> ImportResult:
        """Pull the ticket's sandbox from the node at ``source_url`` and register it
        here, HIBERNATED. Raises InvalidArgument (a malformed ticket, another node
        key, a refused stream: bad, short, over its bound or failing its checksum),
        Conflict (the id is in use here), InsufficientCapacity (admission: no room
        for it here, as for a create of its size; asked before the source is),
        Unavailable/PermissionDenied from the source. On any failure or
        cancellation nothing of it is left here."""
        record = _record_of(ticket)
        if not source_url.startswith(("http://", "https://")) or len(source_url) > 2048:
            raise InvalidArgument(f"a source URL is http(s)://host:port, not {source_url[:80]!r}")
        if ticket.key_id != self._key_id:
            raise InvalidArgument(
                "the sandbox is sealed with another node key", sandbox_id=ticket.sandbox_id
            )
        registry = self._registry
        sid = record.sandbox_id
        check_runs_here(registry, record)
        record = replace(record, run_dir=str(registry.run_root / sid))
        async with registry.lock(sid):
            if sid in registry.sandboxes:
                raise Conflict(f"sandbox {sid} exists on this node", sandbox_id=sid)
            # Admitted like a create, before a byte moves: room for its volume in the
            # pool, one more sandbox, and memory to wake it (it moves to be woken here).
            claim = Claim.sandbox(record.spec.memory_mib, record.spec.disk_mib)
            with registry.admission.claim({sid: claim}, sandbox_id=sid):
                parent = await asyncio.to_thread(_shared_parent, registry.pool.root, ticket.parents)
                staging = await new_staging(registry.pool)
                try:
                    size = await self._receive(ticket, source_url, parent, staging, record)
                finally:
                    await asyncio.shield(self._clear(staging))
            sandbox = registry.sandboxes[sid]
            return ImportResult(sandbox.record.status(), size, parent)

    async def _receive(
        self,
        ticket: ExportTicket,
        source_url: str,
        parent: str | None,
        staging: Path,
        record: SandboxRecord,
    ) -> int:
        registry = self._registry
        pool = registry.pool
        source = self._remote(source_url, ticket.ticket)
        try:
            frames = _Frames(source.stream_export(record.sandbox_id, ticket.ticket, parent))
            # The target's own bound, whatever the ticket says.
            max_bytes = min(ticket.max_stream_bytes, stream_bound(record.spec))
            received = await receive_stream(
                pool.broker, pool.root, staging, frames, max_bytes=max_bytes
            )
        finally:
            await source.aclose()
        # What the root broker read and fed to btrfs receive, hashed there, must be
        # what the source hashed as it sent.
        if frames.trailer != (received.sha256, received.stream_bytes):
            raise InvalidArgument("the stream failed its checksum", sandbox_id=record.sandbox_id)
        await install_received(registry, record, received.path)
        return received.stream_bytes

    async def _clear(self, staging: Path) -> None:
        await clear_staging(self._registry.pool, staging)


def check_runs_here(registry: Registry, record: SandboxRecord) -> None:
    """Raise InvalidArgument unless a sandbox of ``record`` from another node can run
    here: its egress policy within this node's bounds, its guest type offered."""
    parse_policy(record.spec.egress, record.sandbox_id, registry.config.egress_bounds)
    if record.guest not in registry.guest_types:
        raise InvalidArgument(
            f"guest {record.guest} is not offered by this node "
            f"(it offers {', '.join(registry.guest_types)})",
            sandbox_id=record.sandbox_id,
        )


async def install_received(registry: Registry, record: SandboxRecord, received: Path) -> None:
    """Make the received subvolume ``received`` the volume of ``record`` (HIBERNATED)
    and register the sandbox here, its network set up. Called under the sandbox's lock;
    on any failure nothing of it is left."""
    pool = registry.pool
    await adopt_received(pool.broker, received, writable=True, guest_tree=record.guest == "gvisor")
    volume = pool.sandbox_path(record.volume)
    await registry.remove_leftovers(record.sandbox_id, volume=record.volume)
    await asyncio.to_thread(os.rename, received, volume)
    try:
        spec = record.spec
        await pool.limit(volume, volume_limit_mib(spec.disk_mib, spec.memory_mib) << 20)
        registry.store.save(record)
        sandbox = registry.live(record)
        registry.sandboxes[record.sandbox_id] = sandbox
        await registry.network.apply(sandbox)
    except BaseException:
        sandbox = registry.sandboxes.get(record.sandbox_id) or registry.live(record)
        await asyncio.shield(registry.destroy(sandbox))
        raise


async def new_staging(pool: BtrfsPool) -> Path:
    """A new, empty staging directory under the pool's ``incoming/`` for one receive
    (``clear_staging`` removes it; a restart's ``sweep`` removes what a crash left)."""
    staging = pool.root / "incoming" / secrets.token_hex(8)
    await asyncio.to_thread(staging.mkdir, 0o700, parents=True)
    return staging


async def clear_staging(pool: BtrfsPool, staging: Path) -> None:
    """Delete a staging directory under ``incoming/`` and what was received in it."""
    with contextlib.suppress(OSError, NodeError):
        for entry in await asyncio.to_thread(lambda: list(staging.iterdir())):
            await pool.delete_staged(entry)
        await asyncio.to_thread(shutil.rmtree, staging, True)


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.iterdir()) if directory.is_dir() else []


class _Frames:
    """The send stream inside a framed stream (see the module docstring), checked as
    it comes: bounded frames, nothing after the trailer. Iterating yields the data;
    ``trailer`` is (sha256 hex, length) once the stream ended properly."""

    def __init__(self, stream: AsyncIterator[bytes]) -> None:
        self._stream = stream
        self.trailer: tuple[str, int] | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        buffer = bytearray()
        async for piece in self._stream:
            if self.trailer is not None:
                raise InvalidArgument("bytes after the stream's trailer")
            buffer += piece
            while (data := self._frame(buffer)) is not None:
                if data:
                    yield data
            if len(buffer) > STREAM_CHUNK_BYTES + 64:
                raise InvalidArgument("a stream frame over its bound")
        if self.trailer is None or buffer:
            raise InvalidArgument("the stream was cut before its trailer")

    def _frame(self, buffer: bytearray) -> bytes | None:
        """Take one whole frame off ``buffer``: its data (b"" for the trailer), or None."""
        if not buffer or self.trailer is not None:
            return None
        kind = bytes(buffer[:1])
        if kind == _END:
            if len(buffer) < 1 + _TRAILER.size:
                return None
            digest, total = _TRAILER.unpack_from(buffer, 1)
            self.trailer = (digest.hex(), total)
            del buffer[: 1 + _TRAILER.size]
            return b""
        if kind != _DATA:
            raise InvalidArgument("not a move stream")
        if len(buffer) < 1 + _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(buffer, 1)
        if length == 0 or length > STREAM_CHUNK_BYTES:
            raise InvalidArgument(f"a stream frame of {length} bytes")
        end = 1 + _LENGTH.size + length
        if len(buffer) < end:
            return None
        data = bytes(buffer[1 + _LENGTH.size : end])
        del buffer[:end]
        return data


def stream_bound(shape: SandboxSpec | SnapshotInfo) -> int:
    """The most bytes a stream of a sandbox (or snapshot) of ``shape`` may take: its
    volume's bound (disk and saved memory) and btrfs send's framing."""
    limit = volume_limit_mib(shape.disk_mib, shape.memory_mib) << 20
    return max(int(limit * STREAM_SLACK), _MIN_STREAM_BYTES)


def portable_record(record: SandboxRecord) -> dict[str, object]:
    """What of a record travels: not where it ran here, nor what was under way."""
    data = record.to_json()
    for key in ("run_dir", "vmm_pid", "pending", "error", "head_snapshot"):
        data.pop(key, None)
    data["volume"] = record.sandbox_id
    return data


def _record_of(ticket: ExportTicket) -> SandboxRecord:
    """The sandbox record a ticket carries, checked. Raises InvalidArgument."""
    if not 0 < ticket.max_stream_bytes <= 1 << 40:
        raise InvalidArgument("a ticket's max_stream_bytes is out of range")
    return record_from(ticket.record, ticket.sandbox_id)


def record_from(data: object, sandbox_id: str) -> SandboxRecord:
    """The hibernated sandbox ``sandbox_id``'s record from another node (``portable_record``
    made it), checked as hostile. Raises InvalidArgument."""
    if not isinstance(data, dict) or len(data) > _MAX_RECORD_KEYS:
        raise InvalidArgument("a moved sandbox's record is an object")
    try:
        record = SandboxRecord.from_json({**data, "run_dir": "", "vmm_pid": None})
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"a moved sandbox's record is malformed: {exc}") from exc
    check_id(record.sandbox_id)
    spec = record.spec
    for name, allowed in RESOURCES.items():
        refusal = allowed.refusal(name, getattr(spec, name))
        if refusal is not None:
            raise InvalidArgument(refusal, sandbox_id=spec.sandbox_id)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in spec.env.items()):
        raise InvalidArgument("env must map strings to strings", sandbox_id=spec.sandbox_id)
    if record.sandbox_id != sandbox_id or record.state != SandboxState.HIBERNATED:
        raise InvalidArgument(f"the record is not of hibernated sandbox {sandbox_id}")
    return replace(record, run_dir="", volume=record.sandbox_id, pending=None, error=None)


def _template_subvolumes(pool_root: Path) -> list[tuple[Path, SubvolumeIds]]:
    """The read-only subvolumes under templates/<name>/ (templates and ready states)."""
    found = []
    for name_dir in sorted((pool_root / "templates").iterdir()):
        if name_dir.is_symlink() or not name_dir.is_dir():
            continue
        for path in sorted(name_dir.iterdir()):
            with contextlib.suppress(InvalidArgument, OSError):
                if not path.is_symlink() and is_read_only_subvolume(path):
                    found.append((path, subvolume_ids(path)))
    return found


def _origins(pool_root: Path, volume: Path, template_digest: str) -> dict[str, Path]:
    """The read-only subvolumes a stream of ``volume`` may be incremental against, by
    stream id: the one it was snapshotted from, if read-only, and its template's
    (``template_digest``). Any read-only parent gives a correct stream (it describes
    the volume as differences from the parent); one sharing extents with the volume
    gives a small one. A sandbox woken from a ready state (a writable subvolume: QEMU
    opens its RAM file read-write) comes from its template's build, which shares the
    disk image's extents."""
    origin = subvolume_ids(volume).parent_uuid
    return {
        ids.stream_id: path
        for path, ids in _template_subvolumes(pool_root)
        if ids.uuid == origin or path.name == template_digest
    }


def _shared_parent(pool_root: Path, parents: list[str]) -> str | None:
    """Which of ``parents`` a subvolume here is (by the UUID a stream names it with:
    it was received from it, or it is it); None if none is."""
    wanted = set(parents[:16])
    for _path, ids in _template_subvolumes(pool_root):
        for candidate in (ids.received_uuid, ids.uuid):
            if candidate in wanted:
                return candidate
    return None


async def framed(chunks: AsyncIterable[bytes]) -> AsyncGenerator[bytes, None]:
    """The send stream ``chunks`` framed (see the module docstring): what a source
    answers, for moves and template shipping (space.node.agent._shipping)."""
    digest, total = hashlib.sha256(), 0
    async for chunk in chunks:
        # hashlib lets go of the GIL for large buffers: the loop runs on meanwhile.
        await asyncio.to_thread(digest.update, chunk)
        total += len(chunk)
        yield _DATA + _LENGTH.pack(len(chunk)) + chunk
    yield _END + _TRAILER.pack(digest.digest(), total)


def frames_of(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The send stream framed as ``stream`` frames it (for tests)."""
    return framed(chunks)
