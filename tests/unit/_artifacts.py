"""Helpers of the artifact store's tests: streams in odd pieces, raw reads and writes."""

from __future__ import annotations

from collections.abc import AsyncIterator

from space.node.artifacts import ArtifactStore


async def pieces(data: bytes, size: int = 65_521) -> AsyncIterator[bytes]:
    """``data`` in pieces of ``size`` (a prime by default: never aligned to a chunk)."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def failing(data: bytes, after_bytes: int) -> AsyncIterator[bytes]:
    """``data`` in pieces, then an error once ``after_bytes`` have gone."""
    sent = 0
    async for piece in pieces(data):
        if sent >= after_bytes:
            raise RuntimeError("the source broke")
        sent += len(piece)
        yield piece


async def read(store: ArtifactStore, name: str) -> bytes:
    return b"".join([piece async for piece in store.get(name)])


async def read_until_error(store: ArtifactStore, name: str) -> tuple[bytes, BaseException]:
    """What came out before the read failed, and the error (fails if it did not)."""
    out = bytearray()
    try:
        async for piece in store.get(name):
            out += piece
    except Exception as exc:
        return bytes(out), exc
    raise AssertionError(f"reading {name} did not fail")
