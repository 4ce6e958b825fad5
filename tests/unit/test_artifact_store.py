"""The artifact store's conformance suite (space/node/artifacts), run on every backend:
the filesystem one and S3 against a real moto server process. Plain and sealed."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from space.node.api import InvalidArgument, NotFound, ResourceExhausted
from space.node.artifacts import (
    MAX_NAME_BYTES,
    ArtifactStore,
    FilesystemStore,
    InvalidName,
    MasterKey,
    ObjectInfo,
    ObjectTooLarge,
    S3Settings,
    S3Store,
    SealedStore,
    StoreUnavailable,
)
from tests.unit._artifacts import failing, pieces, read

pytestmark = pytest.mark.anyio

MIB = 1 << 20


def sealed(backend: ArtifactStore) -> SealedStore:
    return SealedStore(backend, MasterKey.from_bytes(bytes(range(32))))


async def test_a_multi_mib_object_streams_in_and_out_whole(artifact_backend: ArtifactStore) -> None:
    data = os.urandom(12 * MIB + 7)
    info = await artifact_backend.put("snapshots/s1/disk", pieces(data))
    assert info == ObjectInfo("snapshots/s1/disk", len(data))
    assert await artifact_backend.head("snapshots/s1/disk") == info
    sizes = [len(piece) async for piece in artifact_backend.get("snapshots/s1/disk")]
    assert sum(sizes) == len(data) and max(sizes) <= MIB  # streamed, never whole
    assert await read(artifact_backend, "snapshots/s1/disk") == data


S3_ONLY = pytest.mark.parametrize("artifact_backend", ["s3"], indirect=True)


@S3_ONLY
async def test_a_large_object_goes_to_s3_as_a_multipart_upload(
    artifact_backend: ArtifactStore,
) -> None:
    assert isinstance(artifact_backend, S3Store)
    client = artifact_backend._client
    calls: list[int] = []
    upload_part = client.upload_part

    def counting(**kwargs: object) -> object:
        calls.append(len(kwargs["Body"]))  # type: ignore[arg-type]
        return upload_part(**kwargs)

    client.upload_part = counting
    data = os.urandom(11 * MIB)
    await artifact_backend.put("big", pieces(data))
    assert calls == [5 * MIB, 5 * MIB, MIB]  # one part held at a time
    assert await read(artifact_backend, "big") == data
    calls.clear()
    await artifact_backend.put("small", pieces(data[: 5 * MIB]))
    assert calls == []  # one PutObject


async def test_an_empty_object_round_trips(artifact_backend: ArtifactStore) -> None:
    await artifact_backend.put("empty", pieces(b""))
    assert await artifact_backend.head("empty") == ObjectInfo("empty", 0)
    assert await read(artifact_backend, "empty") == b""
    store = sealed(artifact_backend)
    await store.put("sealed-empty", pieces(b""))
    assert await read(store, "sealed-empty") == b""


async def test_a_sealed_multi_mib_object_round_trips_and_stores_no_plaintext(
    artifact_backend: ArtifactStore,
) -> None:
    store = sealed(artifact_backend)
    # Compressible, recognisable plaintext: any of it stored in the clear would show.
    data = (b"SPACE-PLAINTEXT-" * (MIB // 16)) * 6 + b"tail"
    info = await store.put("hibernated/sb1/ram", pieces(data))
    assert await store.head("hibernated/sb1/ram") == info
    assert info.size_bytes > len(data)  # envelope, headers and a tag per chunk
    stored = await read(artifact_backend, "hibernated/sb1/ram")
    assert len(stored) == info.size_bytes
    assert b"SPACE-PLAINTEXT" not in stored and b"tail" not in stored[-64:]
    assert await read(store, "hibernated/sb1/ram") == data


async def test_two_seals_of_one_plaintext_differ(artifact_backend: ArtifactStore) -> None:
    store = sealed(artifact_backend)
    await store.put("a", pieces(b"same"))
    await store.put("b", pieces(b"same"))
    raw_a, raw_b = await read(artifact_backend, "a"), await read(artifact_backend, "b")
    assert raw_a[24:] != raw_b[24:]  # another data key, another nonce: nothing alike


async def test_put_replaces_and_delete_is_idempotent(artifact_backend: ArtifactStore) -> None:
    await artifact_backend.put("x/y", pieces(b"first"))
    await artifact_backend.put("x/y", pieces(b"second!"))
    assert await read(artifact_backend, "x/y") == b"second!"
    assert await artifact_backend.exists("x/y")
    await artifact_backend.delete("x/y")
    assert not await artifact_backend.exists("x/y")
    assert await artifact_backend.head("x/y") is None
    await artifact_backend.delete("x/y")  # again: no error
    with pytest.raises(NotFound):
        await read(artifact_backend, "x/y")


async def test_list_gives_the_objects_under_a_prefix_sorted(
    artifact_backend: ArtifactStore,
) -> None:
    for name in ["b/2", "a/1", "b/1", "b/10/x", "bb/1", "c"]:
        await artifact_backend.put(name, pieces(name.encode()))
    assert [i.name for i in await artifact_backend.list("b/")] == ["b/1", "b/10/x", "b/2"]
    assert [i.name for i in await artifact_backend.list("b")] == [
        "b/1", "b/10/x", "b/2", "bb/1",
    ]  # fmt: skip
    assert [i.name for i in await artifact_backend.list()] == [
        "a/1", "b/1", "b/10/x", "b/2", "bb/1", "c",
    ]  # fmt: skip
    assert await artifact_backend.list("b/10/") == [ObjectInfo("b/10/x", 6)]
    assert await artifact_backend.list("nothing/") == []


BAD_NAMES = [
    "", "/abs", "a/", "a//b", "..", "../x", "a/../b", "a/./b", ".hidden", "a/.put-1",
    "a b", "a\\b", "ä", "a\x00b", "-x", "x" * (MAX_NAME_BYTES + 1),
]  # fmt: skip


@pytest.mark.parametrize("name", BAD_NAMES)
async def test_negative_an_invalid_name_is_refused_by_every_call(
    artifact_backend: ArtifactStore, name: str
) -> None:
    for store in (artifact_backend, sealed(artifact_backend)):
        with pytest.raises(InvalidName) as info:
            await store.put(name, pieces(b"data"))
        assert isinstance(info.value, InvalidArgument)
        for call in (store.head, store.exists, store.delete):
            with pytest.raises(InvalidName):
                await call(name)
        with pytest.raises(InvalidName):
            await read(store, name)
    assert await artifact_backend.list() == []  # nothing was written anywhere


@pytest.mark.parametrize("prefix", ["/", "../", "a//", ".x", "a/../"])
async def test_negative_an_invalid_list_prefix_is_refused(
    artifact_backend: ArtifactStore, prefix: str
) -> None:
    with pytest.raises(InvalidName):
        await artifact_backend.list(prefix)


async def test_a_name_of_the_maximum_length_is_taken(artifact_backend: ArtifactStore) -> None:
    name = "/".join(["a" * 99] * 5) + "/" + "b" * 12  # 5 * 100 + 12 = 512 bytes
    assert len(name) == MAX_NAME_BYTES
    await artifact_backend.put(name, pieces(b"ok"))
    assert await read(artifact_backend, name) == b"ok"


async def test_negative_an_object_over_the_bound_is_refused_and_nothing_changes(
    artifact_backend: ArtifactStore,
) -> None:
    artifact_backend.max_object_bytes = 6 * MIB  # type: ignore[attr-defined]
    await artifact_backend.put("o", pieces(b"before"))
    exact = os.urandom(6 * MIB)
    await artifact_backend.put("exact", pieces(exact))  # the bound itself is taken
    with pytest.raises(ObjectTooLarge) as info:
        await artifact_backend.put("o", pieces(exact + b"!"))
    assert isinstance(info.value, ResourceExhausted)
    assert await read(artifact_backend, "o") == b"before"
    assert await read(artifact_backend, "exact") == exact
    await _assert_no_leftovers(artifact_backend)


async def test_negative_a_stream_failing_half_way_leaves_the_name_as_it_was(
    artifact_backend: ArtifactStore,
) -> None:
    data = os.urandom(12 * MIB)
    with pytest.raises(RuntimeError, match="the source broke"):
        await artifact_backend.put("half", failing(data, 11 * MIB))  # past two S3 parts
    assert not await artifact_backend.exists("half")
    await artifact_backend.put("kept", pieces(b"old"))
    with pytest.raises(RuntimeError):
        await sealed(artifact_backend).put("kept", failing(data, 2 * MIB))
    assert await read(artifact_backend, "kept") == b"old"
    await _assert_no_leftovers(artifact_backend)


async def _assert_no_leftovers(backend: ArtifactStore) -> None:
    """No temporary file (filesystem) or multipart upload in progress (S3) remains."""
    if isinstance(backend, FilesystemStore):
        hidden = [p for p in backend.root.rglob(".*")]
        assert hidden == []
    else:
        assert isinstance(backend, S3Store)
        uploads = backend._client.list_multipart_uploads(Bucket=backend.bucket)
        assert uploads.get("Uploads", []) == []


async def test_the_filesystem_store_is_owner_only_and_hides_temporaries(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path / "store")
    await store.put("a/b/c", pieces(b"data"))
    for path in [store.root, store.root / "a", store.root / "a" / "b"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert stat.S_IMODE((store.root / "a/b/c").stat().st_mode) == 0o600
    (store.root / "a" / ".put-deadbeef").write_bytes(b"half an object")
    assert [i.name for i in await store.list()] == ["a/b/c"]
    assert await store.sweep_temporaries() == 1
    assert not (store.root / "a" / ".put-deadbeef").exists()


async def test_negative_the_filesystem_store_follows_no_link(tmp_path: Path) -> None:
    store = FilesystemStore(tmp_path / "store")
    await store.put("real", pieces(b"x"))
    secret = tmp_path / "secret"
    secret.write_bytes(b"not an artifact")
    (store.root / "link").symlink_to(secret)
    assert await store.head("link") is None
    with pytest.raises(NotFound):
        await read(store, "link")
    assert [i.name for i in await store.list()] == ["real"]


async def test_negative_a_put_cancelled_half_way_leaves_nothing(
    artifact_backend: ArtifactStore,
) -> None:
    sent = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        async for piece in pieces(os.urandom(11 * MIB)):  # past two S3 parts
            yield piece
        sent.set()
        await asyncio.Event().wait()  # the rest never comes

    for store in (artifact_backend, sealed(artifact_backend)):
        task = asyncio.create_task(store.put("cancelled", stalls()))
        await asyncio.wait_for(sent.wait(), timeout=60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        sent.clear()
        assert not await artifact_backend.exists("cancelled")
        await _assert_no_leftovers(artifact_backend)


async def test_negative_an_unreachable_s3_endpoint_is_unavailable_not_a_boto_error() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        settings = S3Settings(
            bucket="b-1",
            endpoint_url=f"http://127.0.0.1:{port}",
            access_key_id="k",
            secret_access_key="s",
            connect_timeout_s=1.0,
        )
        store = S3Store(settings)
        with pytest.raises(StoreUnavailable, match="S3 head x"):
            await store.head("x")
        with pytest.raises(StoreUnavailable):
            await store.put("x", pieces(b"data"))


@S3_ONLY
async def test_negative_a_missing_bucket_is_not_found(artifact_backend: ArtifactStore) -> None:
    assert isinstance(artifact_backend, S3Store)
    other = S3Store(replace(artifact_backend.settings, bucket="no-such-bucket-here"))
    with pytest.raises(NotFound, match="NoSuchBucket"):
        await other.put("x", pieces(b"data"))
