"""The sealed-state format (space/node/vmm/sealed_state.py): round trips, and every way
to tamper with a sealed stream fails before anything unverified comes out."""

from __future__ import annotations

import io
import os
import struct

import pytest

from space.node.api import Unavailable
from space.node.vmm.sealed_state import (
    HEADER_BYTES,
    MAGIC,
    MAX_CHUNK_BYTES,
    TAG_BYTES,
    NotAuthentic,
    Opener,
    Sealer,
    is_sealed,
    open_chunks,
)

KEY = bytes(range(32))
CHUNK = 64  # small chunks, so a few hundred bytes make several


def seal(data: bytes, *, key: bytes = KEY, chunk_bytes: int = CHUNK, pieces: int = 7) -> bytes:
    out = io.BytesIO()
    sealer = Sealer(key, out.write, chunk_bytes=chunk_bytes)
    for start in range(0, len(data), pieces):  # written in odd pieces, as a pipe gives them
        sealer.update(data[start : start + pieces])
    sealer.finish()
    return out.getvalue()


def unseal(blob: bytes, *, key: bytes = KEY) -> bytes:
    return b"".join(open_chunks(key, io.BytesIO(blob).read))


def chunks_of(blob: bytes, chunk_bytes: int = CHUNK) -> tuple[bytes, list[bytes]]:
    size = chunk_bytes + TAG_BYTES
    body = blob[HEADER_BYTES:]
    return blob[:HEADER_BYTES], [body[i : i + size] for i in range(0, len(body), size)]


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, 3 * CHUNK + 5])
def test_a_sealed_stream_of_any_size_opens_to_what_was_sealed(size: int) -> None:
    data = os.urandom(size)
    blob = seal(data)
    assert unseal(blob) == data
    full, rest = divmod(size, CHUNK)
    # Full chunks, the last one full too at an exact multiple; an empty one only for 0.
    chunks = max(1, full + (1 if rest else 0))
    assert len(blob) == HEADER_BYTES + size + chunks * TAG_BYTES
    assert is_sealed(blob)
    if size >= 16:
        assert data[:16] not in blob


def test_each_chunk_comes_out_alone_and_the_default_chunk_is_a_mebibyte() -> None:
    data = os.urandom(3 << 20)
    out = io.BytesIO()
    sealer = Sealer(KEY, out.write)
    sealer.update(data)
    sealer.finish()
    sizes = [len(c) for c in open_chunks(KEY, io.BytesIO(out.getvalue()).read)]
    assert sizes == [1 << 20] * 3


def test_two_seals_of_the_same_data_differ() -> None:
    data = b"same" * 40
    assert seal(data) != seal(data)  # a random nonce prefix each time


def _fails(blob: bytes, match: str | None = None) -> list[bytes]:
    """Open ``blob`` and expect NotAuthentic; what came out before it."""
    out: list[bytes] = []
    with pytest.raises(NotAuthentic, match=match):
        for chunk in open_chunks(KEY, io.BytesIO(blob).read):
            out.append(chunk)
    return out


@pytest.mark.parametrize("where", [0, len(MAGIC), len(MAGIC) + 3, HEADER_BYTES - 1])
def test_negative_a_flipped_bit_in_the_header_opens_nothing(where: int) -> None:
    blob = bytearray(seal(os.urandom(3 * CHUNK)))
    blob[where] ^= 0x01
    assert _fails(bytes(blob)) == []


@pytest.mark.parametrize("offset", [0, CHUNK - 1, CHUNK, CHUNK + TAG_BYTES - 1])
def test_negative_a_flipped_bit_in_a_chunk_or_its_tag_stops_at_that_chunk(offset: int) -> None:
    data = os.urandom(3 * CHUNK)
    blob = bytearray(seal(data))
    blob[HEADER_BYTES + (CHUNK + TAG_BYTES) + offset] ^= 0x80  # the second chunk
    assert _fails(bytes(blob), "chunk 1") == [data[:CHUNK]]


def test_negative_a_stream_cut_at_a_chunk_boundary_or_inside_one_fails_at_its_end() -> None:
    data = os.urandom(3 * CHUNK + 10)
    blob = seal(data)
    header, chunks = chunks_of(blob)
    assert _fails(header + b"".join(chunks[:2])) == [data[:CHUNK]]
    assert b"".join(_fails(blob[:-1])) == data[: 3 * CHUNK]
    assert _fails(blob[: HEADER_BYTES + 5], "cut short") == []
    assert _fails(header) == []
    assert _fails(blob[: HEADER_BYTES - 1], "no sealed-state header") == []
    assert _fails(b"") == []


def test_negative_dropped_swapped_or_duplicated_chunks_fail() -> None:
    data = os.urandom(4 * CHUNK)
    header, chunks = chunks_of(seal(data))
    a, b, c, d = chunks
    assert _fails(header + a + c + d) == [data[:CHUNK]]
    assert _fails(header + b + a + c + d) == []
    assert _fails(header + a + a + c + d) == [data[:CHUNK]]
    assert b"".join(_fails(header + a + b + c + d + d)) == data[: 3 * CHUNK]
    assert _fails(header + a + b + c) == [data[:CHUNK], data[CHUNK : 2 * CHUNK]]


@pytest.mark.parametrize("extra_bytes", [1, TAG_BYTES, CHUNK + TAG_BYTES])
def test_negative_data_after_the_last_chunk_fails_that_chunk(extra_bytes: int) -> None:
    data = os.urandom(2 * CHUNK)
    assert _fails(seal(data) + os.urandom(extra_bytes)) == [data[:CHUNK]]


def test_negative_a_chunk_from_another_stream_under_the_same_key_fails() -> None:
    data = os.urandom(2 * CHUNK)
    header, (first, _) = chunks_of(seal(data))
    _, (_, other_second) = chunks_of(seal(data))
    assert _fails(header + first + other_second) == [data[:CHUNK]]


def test_negative_another_key_opens_nothing() -> None:
    blob = seal(os.urandom(2 * CHUNK))
    with pytest.raises(NotAuthentic) as info:
        unseal(blob, key=os.urandom(32))
    assert isinstance(info.value, Unavailable)


def _header(version: int = 1, chunk_bytes: int = CHUNK) -> bytes:
    return MAGIC + struct.pack(">BI", version, chunk_bytes) + bytes(7)


def test_negative_a_chunk_size_past_the_maximum_is_refused_before_any_read() -> None:
    reads: list[int] = []

    def read(n: int) -> bytes:
        reads.append(n)
        return _header(chunk_bytes=MAX_CHUNK_BYTES + 1) if len(reads) == 1 else b"x" * n

    with pytest.raises(NotAuthentic, match="chunk size"):
        next(open_chunks(KEY, read))
    assert reads == [HEADER_BYTES]  # the header alone: nothing of the chunk's size


def test_the_maximum_chunk_size_itself_is_read() -> None:
    with pytest.raises(NotAuthentic, match="chunk 0"):  # read, then fails its tag
        next(open_chunks(KEY, io.BytesIO(_header(chunk_bytes=MAX_CHUNK_BYTES) + b"x" * 40).read))


@pytest.mark.parametrize(
    ("header", "match"), [(_header(chunk_bytes=0), "chunk size"), (_header(version=2), "version")]
)
def test_negative_a_zero_chunk_size_or_unknown_version_is_refused(
    header: bytes, match: str
) -> None:
    with pytest.raises(NotAuthentic, match=match):
        next(open_chunks(KEY, io.BytesIO(header + bytes(64)).read))


def test_negative_a_sealer_refuses_chunk_sizes_a_reader_would() -> None:
    for size in (0, MAX_CHUNK_BYTES + 1):
        with pytest.raises(ValueError):
            Sealer(KEY, io.BytesIO().write, chunk_bytes=size)
    sealer = Sealer(KEY, io.BytesIO().write)
    sealer.finish()
    with pytest.raises(ValueError):
        sealer.update(b"late")


def test_a_qemu_stream_is_not_taken_for_a_sealed_one() -> None:
    assert not is_sealed(b"QEVM\x00\x00\x00\x03")  # QEMU's own migration stream magic
    assert not is_sealed(b"")
    assert is_sealed(seal(b""))


@pytest.mark.parametrize("piece", [1, 13, CHUNK + TAG_BYTES, 1000])
def test_an_opener_fed_in_any_pieces_gives_the_chunks_as_they_complete(piece: int) -> None:
    data = os.urandom(3 * CHUNK + 5)
    blob = seal(data)
    opener = Opener(KEY)
    out: list[bytes] = []
    for start in range(0, len(blob), piece):
        out.extend(opener.feed(blob[start : start + piece]))
    assert b"".join(out) == data[: 3 * CHUNK]  # the last is not known as such yet
    assert out and all(len(chunk) == CHUNK for chunk in out)
    assert opener.finish() == data[3 * CHUNK :]
    with pytest.raises(ValueError):
        opener.feed(b"late")


def test_negative_an_opener_refuses_a_cut_stream_at_its_finish() -> None:
    data = os.urandom(2 * CHUNK)
    blob = seal(data)
    opener = Opener(KEY)
    assert opener.feed(blob[:-3]) == [data[:CHUNK]]  # the first, followed by more
    with pytest.raises(NotAuthentic, match="chunk 1"):
        opener.finish()  # the last chunk, cut short
    with pytest.raises(NotAuthentic, match="no sealed-state header"):
        Opener(KEY).finish()
