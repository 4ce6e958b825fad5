"""Sealed artifacts (space/node/artifacts/_sealed.py) on every backend: any change to
the stored bytes, any cut, any reordering, another object's bytes and another master key
are refused with NotAuthentic, and nothing unverified comes out first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from space.node.api import Unavailable
from space.node.artifacts import (
    ArtifactStore,
    MasterKey,
    NotAuthentic,
    SealedStore,
    WrongMasterKey,
)
from space.node.artifacts._sealed import ENVELOPE_BYTES
from space.node.core.keys import KeyFileError
from space.node.vmm.sealed_state import HEADER_BYTES, TAG_BYTES
from tests.unit._artifacts import pieces, read, read_until_error

pytestmark = pytest.mark.anyio

CHUNK = 4096  # small chunks, so a few KiB make several
SEALED_CHUNK = CHUNK + TAG_BYTES
FIRST_CHUNK = ENVELOPE_BYTES + HEADER_BYTES
KEY = MasterKey.from_bytes(bytes(range(32)))
DATA = os.urandom(4 * CHUNK + 100)  # four full chunks and a short last one


def store_on(backend: ArtifactStore, key: MasterKey = KEY) -> SealedStore:
    return SealedStore(backend, key, chunk_bytes=CHUNK)


async def stored(backend: ArtifactStore, name: str = "obj") -> bytes:
    """DATA sealed under ``name``; the bytes the backend holds."""
    await store_on(backend).put(name, pieces(DATA, 1000))
    return await read(backend, name)


async def refused(backend: ArtifactStore, raw: bytes, match: str | None = None) -> bytes:
    """Put ``raw`` as the object "obj", read it sealed: NotAuthentic; what came out."""
    await backend.put("obj", pieces(raw))
    out, error = await read_until_error(store_on(backend), "obj")
    assert isinstance(error, NotAuthentic) and isinstance(error, Unavailable), error
    if match is not None:
        assert match in str(error)
    assert "obj" in str(error)  # names the artifact
    assert DATA.startswith(out)  # only verified plaintext came out, in order
    return out


async def test_the_stored_layout_is_envelope_header_and_chunks(
    artifact_backend: ArtifactStore,
) -> None:
    raw = await stored(artifact_backend)
    assert raw.startswith(b"\x89SPACEAR")
    assert len(raw) == FIRST_CHUNK + len(DATA) + 5 * TAG_BYTES
    assert await read(store_on(artifact_backend), "obj") == DATA


@pytest.mark.parametrize(
    "offset",
    [
        0,  # the envelope's magic
        9,  # its master key id
        ENVELOPE_BYTES - 20,  # its wrapped data key
        ENVELOPE_BYTES + 12,  # the sealed stream's header
        FIRST_CHUNK + SEALED_CHUNK + 5,  # the second chunk
        -1,  # the last chunk's tag
    ],
)
async def test_negative_a_flipped_bit_anywhere_is_refused(
    artifact_backend: ArtifactStore, offset: int
) -> None:
    raw = bytearray(await stored(artifact_backend))
    raw[offset] ^= 0x04
    out = await refused(artifact_backend, bytes(raw))
    assert len(out) <= 4 * CHUNK  # the last chunk never came out


async def test_negative_a_flipped_bit_in_a_chunk_stops_at_that_chunk(
    artifact_backend: ArtifactStore,
) -> None:
    raw = bytearray(await stored(artifact_backend))
    raw[FIRST_CHUNK + 2 * SEALED_CHUNK + 1] ^= 0x80  # the third chunk
    assert await refused(artifact_backend, bytes(raw), "chunk 2") == DATA[: 2 * CHUNK]


@pytest.mark.parametrize(
    "keep",
    [
        ENVELOPE_BYTES - 1,  # inside the envelope
        ENVELOPE_BYTES,  # the envelope alone
        FIRST_CHUNK + 2 * SEALED_CHUNK,  # at a chunk boundary
        FIRST_CHUNK + 2 * SEALED_CHUNK + 10,  # inside a chunk
        -1,  # all but the last byte
    ],
)
async def test_negative_a_truncated_object_is_refused(
    artifact_backend: ArtifactStore, keep: int
) -> None:
    raw = await stored(artifact_backend)
    await refused(artifact_backend, raw[:keep])


async def test_negative_swapped_dropped_or_repeated_chunks_are_refused(
    artifact_backend: ArtifactStore,
) -> None:
    raw = await stored(artifact_backend)
    head, body = raw[:FIRST_CHUNK], raw[FIRST_CHUNK:]
    c = [body[i : i + SEALED_CHUNK] for i in range(0, len(body), SEALED_CHUNK)]
    assert len(c) == 5
    assert await refused(artifact_backend, head + c[1] + c[0] + b"".join(c[2:])) == b""
    assert await refused(artifact_backend, head + c[0] + b"".join(c[2:])) == DATA[:CHUNK]
    assert await refused(artifact_backend, head + c[0] + c[0] + b"".join(c[2:])) == DATA[:CHUNK]
    await refused(artifact_backend, raw + c[4])  # data after the last chunk


async def test_negative_another_objects_bytes_under_this_name_are_refused(
    artifact_backend: ArtifactStore,
) -> None:
    other = await stored(artifact_backend, "other")
    # The whole of another object: its data key was wrapped for its own name.
    await refused(artifact_backend, other, "does not unwrap")
    # This object's envelope with another object's chunks: another data key.
    mine = await stored(artifact_backend, "obj")
    assert await refused(artifact_backend, mine[:ENVELOPE_BYTES] + other[ENVELOPE_BYTES:]) == b""


async def test_negative_a_wrong_master_key_opens_nothing(artifact_backend: ArtifactStore) -> None:
    await stored(artifact_backend)
    other = MasterKey.from_bytes(os.urandom(32))
    out, error = await read_until_error(store_on(artifact_backend, other), "obj")
    assert out == b""
    assert isinstance(error, WrongMasterKey) and isinstance(error, NotAuthentic)
    assert KEY.key_id.hex() in str(error) and other.key_id.hex() in str(error)
    # The same key id with another wrap key (a forged id) still opens nothing.
    forged = MasterKey(wrap_key=os.urandom(32), key_id=KEY.key_id)
    out, error = await read_until_error(store_on(artifact_backend, forged), "obj")
    assert out == b"" and isinstance(error, NotAuthentic)


async def test_negative_a_plain_object_is_not_taken_for_a_sealed_one(
    artifact_backend: ArtifactStore,
) -> None:
    await refused(artifact_backend, b"x" * 500, "not a sealed artifact")


async def test_the_master_key_file_is_made_owner_only_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "artifact.key"
    made = MasterKey.load(path, create=True)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert MasterKey.load(path) == made  # another node with a copy: the same key
    assert made.wrap_key.hex() not in repr(made)
    path.chmod(0o640)
    with pytest.raises(KeyFileError, match="chmod 600"):
        MasterKey.load(path)
    with pytest.raises(KeyFileError, match=r"artifact master key file .* missing"):
        MasterKey.load(tmp_path / "absent.key")
