"""Bundles (space/node/artifacts/_bundles.py) on every backend, sealed: a bundle is
restorable only when its manifest and every part it lists are there; parts are checked
against their SHA-256 as they stream; deletion never leaves a complete-looking half."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator

import pytest

from space.node.api import Conflict, InvalidArgument, NotFound
from space.node.artifacts import (
    MAX_PARTS,
    ArtifactStore,
    BundleIncomplete,
    ChecksumMismatch,
    MasterKey,
    NotAuthentic,
    SealedStore,
    bundle_complete,
    delete_bundle,
    get_bundle,
    put_bundle,
    read_manifest,
)
from tests.unit._artifacts import pieces, read, read_until_error

pytestmark = pytest.mark.anyio

MIB = 1 << 20
PARTS = {
    "disk": os.urandom(3 * MIB + 11),
    "ram": os.urandom(2 * MIB),
    "device-state": os.urandom(4000),
    "metadata.json": b'{"sandbox": "sb-1"}',
}


def sealed(backend: ArtifactStore) -> SealedStore:
    return SealedStore(backend, MasterKey.from_bytes(bytes(range(32))))


async def put(store: ArtifactStore, bundle: str = "hibernated/sb-1") -> None:
    await put_bundle(store, bundle, [(name, pieces(data)) for name, data in PARTS.items()])


async def read_part(store: ArtifactStore, bundle: str, part: str) -> bytes:
    opened = await get_bundle(store, bundle)
    return b"".join([piece async for piece in opened.part(part)])


async def test_a_bundle_round_trips_with_its_manifest_written_last(
    artifact_backend: ArtifactStore,
) -> None:
    store = sealed(artifact_backend)
    await put(store)
    assert await bundle_complete(store, "hibernated/sb-1")
    manifest = await read_manifest(store, "hibernated/sb-1")
    assert manifest is not None
    assert [(p.name, p.size_bytes, p.sha256) for p in manifest.parts] == [
        (name, len(data), hashlib.sha256(data).hexdigest()) for name, data in PARTS.items()
    ]
    names = [info.name for info in await store.list("hibernated/sb-1/")]
    parts = sorted(f"hibernated/sb-1/parts/{name}" for name in PARTS)
    assert names == ["hibernated/sb-1/manifest", *parts]
    for name, data in PARTS.items():
        assert await read_part(store, "hibernated/sb-1", name) == data
    raw_manifest = await read(artifact_backend, "hibernated/sb-1/manifest")
    assert b"disk" not in raw_manifest  # sealed like every object


async def test_negative_a_bundle_without_its_manifest_is_not_complete(
    artifact_backend: ArtifactStore,
) -> None:
    store = sealed(artifact_backend)
    await put(store)
    await store.delete("hibernated/sb-1/manifest")  # as if the put died before it
    assert not await bundle_complete(store, "hibernated/sb-1")
    with pytest.raises(BundleIncomplete, match="no manifest") as info:
        await get_bundle(store, "hibernated/sb-1")
    assert isinstance(info.value, NotFound)


@pytest.mark.parametrize("part", ["disk", "metadata.json"])
async def test_negative_a_bundle_missing_a_part_is_not_complete(
    artifact_backend: ArtifactStore, part: str
) -> None:
    store = sealed(artifact_backend)
    await put(store)
    await store.delete(f"hibernated/sb-1/parts/{part}")
    assert not await bundle_complete(store, "hibernated/sb-1")
    with pytest.raises(BundleIncomplete, match=f"part {part} is missing"):
        await get_bundle(store, "hibernated/sb-1")


async def test_negative_a_part_of_another_stored_size_is_not_complete(
    artifact_backend: ArtifactStore,
) -> None:
    store = sealed(artifact_backend)
    await put(store)
    await store.put("hibernated/sb-1/parts/ram", pieces(PARTS["ram"][:-1]))
    assert not await bundle_complete(store, "hibernated/sb-1")
    with pytest.raises(BundleIncomplete, match="part ram is"):
        await get_bundle(store, "hibernated/sb-1")


async def test_negative_a_part_of_the_right_size_but_other_bytes_fails_its_checksum(
    artifact_backend: ArtifactStore,
) -> None:
    store = sealed(artifact_backend)
    await put(store)
    changed = bytearray(PARTS["disk"])
    changed[-1] ^= 1  # authentic under the key (sealed anew), but not what was listed
    await store.put("hibernated/sb-1/parts/disk", pieces(bytes(changed)))
    assert await bundle_complete(store, "hibernated/sb-1")  # sizes all match
    opened = await get_bundle(store, "hibernated/sb-1")
    out = bytearray()
    with pytest.raises(ChecksumMismatch, match="part disk") as info:
        async for piece in opened.part("disk"):
            out += piece
    assert isinstance(info.value, NotAuthentic)
    assert len(out) == len(changed)  # found at the end, where the digest is known
    assert await read_part(store, "hibernated/sb-1", "ram") == PARTS["ram"]


async def test_negative_a_longer_part_fails_at_its_first_byte_past_the_listed_size(
    artifact_backend: ArtifactStore,
) -> None:
    # A plain store, so that sizes in the manifest can be made to disagree with a part.
    await put(artifact_backend)
    opened = await get_bundle(artifact_backend, "hibernated/sb-1")  # complete, then changed
    await artifact_backend.put("hibernated/sb-1/parts/ram", pieces(PARTS["ram"] + b"+" * 100))
    with pytest.raises(BundleIncomplete):
        await get_bundle(artifact_backend, "hibernated/sb-1")
    out = bytearray()
    with pytest.raises(ChecksumMismatch, match="over"):
        async for piece in opened.part("ram"):
            out += piece
    assert len(out) <= len(PARTS["ram"])


async def test_negative_a_tampered_manifest_is_refused_not_taken_for_absent(
    artifact_backend: ArtifactStore,
) -> None:
    store = sealed(artifact_backend)
    await put(store)
    raw = bytearray(await read(artifact_backend, "hibernated/sb-1/manifest"))
    raw[-5] ^= 0x10
    await artifact_backend.put("hibernated/sb-1/manifest", pieces(bytes(raw)))
    with pytest.raises(NotAuthentic):
        await bundle_complete(store, "hibernated/sb-1")
    # Another bundle's manifest in this one's place does not pass either.
    await put(store, "hibernated/sb-2")
    other = await read(artifact_backend, "hibernated/sb-2/manifest")
    await artifact_backend.put("hibernated/sb-1/manifest", pieces(other))
    with pytest.raises(NotAuthentic):
        await get_bundle(store, "hibernated/sb-1")


async def test_negative_a_bundle_is_not_stored_twice(artifact_backend: ArtifactStore) -> None:
    store = sealed(artifact_backend)
    await put(store)
    with pytest.raises(Conflict):
        await put_bundle(store, "hibernated/sb-1", [("disk", pieces(b"other"))])
    assert await read_part(store, "hibernated/sb-1", "disk") == PARTS["disk"]


@pytest.mark.parametrize(
    "names",
    [[], ["a", "a"], ["a/b"], ["../x"], [".hidden"], ["x" * 65], [f"p{i}" for i in range(65)]],
)
async def test_negative_bad_part_names_are_refused_before_any_upload(
    artifact_backend: ArtifactStore, names: list[str]
) -> None:
    store = sealed(artifact_backend)
    with pytest.raises(InvalidArgument):
        await put_bundle(store, "b", [(name, pieces(b"x")) for name in names])
    assert await store.list() == []


async def test_the_most_parts_a_bundle_takes(artifact_backend: ArtifactStore) -> None:
    store = sealed(artifact_backend)
    await put_bundle(store, "many", [(f"p{i}", pieces(b"%d" % i)) for i in range(MAX_PARTS)])
    assert await read_part(store, "many", f"p{MAX_PARTS - 1}") == b"%d" % (MAX_PARTS - 1)


async def test_a_failed_put_leaves_an_incomplete_bundle_that_delete_clears(
    artifact_backend: ArtifactStore,
) -> None:
    store = sealed(artifact_backend)

    async def broken() -> AsyncIterator[bytes]:
        yield b"some"
        raise RuntimeError("the disk stream broke")

    with pytest.raises(RuntimeError):
        await put_bundle(store, "b", [("metadata", pieces(b"m")), ("disk", broken())])
    assert not await bundle_complete(store, "b")
    assert [i.name for i in await store.list()] == ["b/parts/metadata"]
    assert await delete_bundle(store, "b") == 1
    assert await store.list() == []


class _DeletesOnce:
    """A store whose deletes fail after the first: a deletion that dies half-way."""

    def __init__(self, inner: ArtifactStore) -> None:
        self.inner = inner
        self.deleted: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def delete(self, name: str) -> None:
        if self.deleted:
            raise RuntimeError("the node died")
        self.deleted.append(name)
        await self.inner.delete(name)


async def test_deleting_removes_the_manifest_first_so_a_half_deleted_bundle_is_not_complete(
    artifact_backend: ArtifactStore,
) -> None:
    store = sealed(artifact_backend)
    await put(store)
    dying = _DeletesOnce(store)
    with pytest.raises(RuntimeError):
        await delete_bundle(dying, "hibernated/sb-1")  # type: ignore[arg-type]
    assert dying.deleted == ["hibernated/sb-1/manifest"]
    assert not await bundle_complete(store, "hibernated/sb-1")
    assert await delete_bundle(store, "hibernated/sb-1") == len(PARTS)
    assert await store.list() == []
    assert await delete_bundle(store, "hibernated/sb-1") == 0  # idempotent


async def test_deleting_a_bundle_leaves_its_neighbours(artifact_backend: ArtifactStore) -> None:
    store = sealed(artifact_backend)
    await put(store, "s/a")
    await put(store, "s/ab")
    await delete_bundle(store, "s/a")
    assert await bundle_complete(store, "s/ab")
    assert not await bundle_complete(store, "s/a")


async def test_a_part_is_read_in_pieces_and_can_be_abandoned(
    artifact_backend: ArtifactStore,
) -> None:
    store = sealed(artifact_backend)
    await put(store)
    opened = await get_bundle(store, "hibernated/sb-1")
    stream = opened.part("disk")
    first = await anext(stream)
    assert PARTS["disk"].startswith(first) and len(first) <= MIB
    await stream.aclose()
    out, error = await read_until_error(store, "hibernated/sb-1/parts/nothing")
    assert out == b"" and isinstance(error, NotFound)
