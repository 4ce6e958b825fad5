"""Bundles: the artifacts of one sandbox (disk stream, RAM file, device state, metadata)
as parts under one name, restorable only once all of them have landed (issue 19).

Layout in the store, for a bundle named ``B``::

    B/parts/<part>    one object per part, uploaded first
    B/manifest        uploaded last: each part's name, size, stored size and SHA-256

A bundle is complete when its manifest is there and every part it lists is there with
its stored size: a put that died half-way left no manifest, so it is not complete, and
``delete_bundle`` removes the manifest before any part, so a half-deleted bundle is not
complete either. Reading a part checks its SHA-256 and size as it streams
(ChecksumMismatch at the first byte past its size, or at its end). Through a
SealedStore the manifest and every part are also sealed (space.node.artifacts._sealed).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncGenerator, AsyncIterable, Sequence
from dataclasses import dataclass
from typing import Any

from space.node.api import Conflict, InvalidArgument, NotFound
from space.node.artifacts._store import (
    ArtifactStore,
    BundleIncomplete,
    ChecksumMismatch,
    NotAuthentic,
    ObjectTooLarge,
    check_name,
)

__all__ = [
    "MAX_PARTS",
    "Bundle",
    "Manifest",
    "PartInfo",
    "bundle_complete",
    "delete_bundle",
    "get_bundle",
    "put_bundle",
    "read_manifest",
]

#: Parts per bundle: a sandbox has a handful (disk, RAM, device state, metadata).
MAX_PARTS = 64
#: A manifest of MAX_PARTS parts is a few KiB; nothing larger is read.
MAX_MANIFEST_BYTES = 64 << 10
_FORMAT = "space-bundle/1"
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PartInfo:
    """One part as the manifest lists it: plaintext ``size_bytes`` and ``sha256`` (hex),
    and ``stored_bytes`` as the store holds it (what completeness checks)."""

    name: str
    size_bytes: int
    stored_bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    bundle: str
    parts: tuple[PartInfo, ...]

    def part(self, name: str) -> PartInfo:
        for part in self.parts:
            if part.name == name:
                return part
        raise NotFound(f"bundle {self.bundle} has no part {name!r}")

    def to_json(self) -> bytes:
        parts = [vars(part) for part in self.parts]
        return json.dumps({"format": _FORMAT, "bundle": self.bundle, "parts": parts}).encode()

    @classmethod
    def from_json(cls, bundle: str, data: bytes) -> Manifest:
        """Parsed and checked; NotAuthentic for anything but a manifest of ``bundle``."""
        try:
            document = json.loads(data)
            parts = tuple(_part(item) for item in document["parts"])
            ok = document["format"] == _FORMAT and document["bundle"] == bundle
        except (ValueError, KeyError, TypeError) as exc:
            raise NotAuthentic(f"the manifest of bundle {bundle} is malformed: {exc}") from None
        if not ok or len({p.name for p in parts}) != len(parts) or len(parts) > MAX_PARTS:
            raise NotAuthentic(f"the manifest of bundle {bundle} is not one of this bundle")
        return cls(bundle, parts)


def _part(item: Any) -> PartInfo:
    name, sha256 = item["name"], item["sha256"]
    size, stored = item["size_bytes"], item["stored_bytes"]
    if not (isinstance(name, str) and _PART.fullmatch(name)):
        raise ValueError(f"part name {name!r}")
    if not (isinstance(sha256, str) and _SHA256.fullmatch(sha256)):
        raise ValueError(f"part sha256 {sha256!r}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (size, stored)):
        raise ValueError(f"part sizes {size!r}, {stored!r}")
    return PartInfo(name, size, stored, sha256)


def _manifest_name(bundle: str) -> str:
    return f"{check_name(bundle)}/manifest"


def _part_name(bundle: str, part: str) -> str:
    return check_name(f"{bundle}/parts/{part}")


async def put_bundle(
    store: ArtifactStore, bundle: str, parts: Sequence[tuple[str, AsyncIterable[bytes]]]
) -> Manifest:
    """Upload ``parts`` (name, byte stream) one after the other, then the manifest.

    Raises Conflict if the bundle already has a manifest (artifacts are immutable:
    delete it first), InvalidArgument for bad or repeated part names or more than
    MAX_PARTS. A failure or cancellation half-way leaves parts without a manifest: not
    complete; ``delete_bundle`` removes them, or a retried put overwrites them.
    """
    names = [name for name, _ in parts]
    bad = [n for n in names if not (isinstance(n, str) and _PART.fullmatch(n))]
    if bad or len(set(names)) != len(names) or not 0 < len(names) <= MAX_PARTS:
        raise InvalidArgument(
            f"bundle {bundle}: 1 to {MAX_PARTS} distinct part names of [A-Za-z0-9._-]"
            f" are needed, got {names!r}"
        )
    manifest_name = _manifest_name(bundle)
    if await store.exists(manifest_name):
        raise Conflict(f"bundle {bundle} exists; delete it before storing it again")
    listed = []
    for name, stream in parts:
        digest = hashlib.sha256()
        counted = _Counted(stream, digest)
        info = await store.put(_part_name(bundle, name), counted.pieces())
        listed.append(PartInfo(name, counted.size_bytes, info.size_bytes, digest.hexdigest()))
    manifest = Manifest(bundle, tuple(listed))
    await store.put(manifest_name, _one(manifest.to_json()))
    return manifest


class _Counted:
    def __init__(self, stream: AsyncIterable[bytes], digest: Any) -> None:
        self._stream = stream
        self._digest = digest
        self.size_bytes = 0

    async def pieces(self) -> AsyncGenerator[bytes, None]:
        async for piece in self._stream:
            self._digest.update(piece)
            self.size_bytes += len(piece)
            yield piece


async def _one(data: bytes) -> AsyncGenerator[bytes, None]:
    yield data


async def read_manifest(store: ArtifactStore, bundle: str) -> Manifest | None:
    """The bundle's manifest, or None if it has none. NotAuthentic for one that is not
    (tampered, another bundle's, sealed under another master key)."""
    data = bytearray()
    try:
        async for piece in store.get(_manifest_name(bundle)):
            data += piece
            if len(data) > MAX_MANIFEST_BYTES:
                raise ObjectTooLarge(
                    f"the manifest of bundle {bundle} is over {MAX_MANIFEST_BYTES}"
                )
    except NotFound:
        return None
    return Manifest.from_json(bundle, bytes(data))


async def _missing(store: ArtifactStore, manifest: Manifest) -> str | None:
    """What keeps the bundle from being complete, or None."""
    for part in manifest.parts:
        info = await store.head(_part_name(manifest.bundle, part.name))
        if info is None:
            return f"part {part.name} is missing"
        if info.size_bytes != part.stored_bytes:
            return f"part {part.name} is {info.size_bytes} bytes stored, not {part.stored_bytes}"
    return None


async def bundle_complete(store: ArtifactStore, bundle: str) -> bool:
    """Whether the bundle is restorable: its manifest there, and every part it lists
    there with its stored size. Raises NotAuthentic for a manifest that is not
    authentic (that is worth an operator's eyes, not a quiet False)."""
    manifest = await read_manifest(store, bundle)
    return manifest is not None and await _missing(store, manifest) is None


@dataclass(frozen=True)
class Bundle:
    """A complete bundle, to read part by part."""

    store: ArtifactStore
    manifest: Manifest

    async def part(self, name: str) -> AsyncGenerator[bytes, None]:
        """The part's bytes, checked against the manifest as they stream: ChecksumMismatch
        at the first byte past its size or, at its end, for a short part or another
        SHA-256. Only a part read to its end without an error is the part."""
        info = self.manifest.part(name)
        digest = hashlib.sha256()
        seen = 0
        async for piece in self.store.get(_part_name(self.manifest.bundle, name)):
            seen += len(piece)
            if seen > info.size_bytes:
                raise ChecksumMismatch(
                    f"bundle {self.manifest.bundle} part {name} is over {info.size_bytes} bytes"
                )
            digest.update(piece)
            yield piece
        if seen != info.size_bytes or digest.hexdigest() != info.sha256:
            raise ChecksumMismatch(
                f"bundle {self.manifest.bundle} part {name}: {seen} bytes of SHA-256"
                f" {digest.hexdigest()}, the manifest lists {info.size_bytes} of {info.sha256}"
            )


async def get_bundle(store: ArtifactStore, bundle: str) -> Bundle:
    """The bundle, to read; BundleIncomplete (a NotFound) unless it is complete."""
    manifest = await read_manifest(store, bundle)
    if manifest is None:
        raise BundleIncomplete(f"bundle {bundle} has no manifest: not restorable")
    problem = await _missing(store, manifest)
    if problem is not None:
        raise BundleIncomplete(f"bundle {bundle} is not complete: {problem}")
    return Bundle(store, manifest)


async def delete_bundle(store: ArtifactStore, bundle: str) -> int:
    """Delete the manifest, then every part (listed or not: a failed put's too); how
    many parts went. Idempotent; interrupted, it leaves an incomplete bundle that a
    second call finishes deleting."""
    await store.delete(_manifest_name(bundle))
    parts = await store.list(f"{bundle}/parts/")
    for info in parts:
        await store.delete(info.name)
    return len(parts)
