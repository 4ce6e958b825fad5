"""Every object sealed under its own data key, the data key wrapped under the master key.

An object in a sealed store is an envelope, then a sealed stream
(space.node.vmm.sealed_state: AES-256-GCM in 1 MiB chunks, each chunk's index and
last-chunk flag in its nonce) of the plaintext under a data key made for this object::

    envelope  magic (8) | version (1) | master key id (8) | wrap nonce (12)
              | AES-256-GCM(wrap key, wrap nonce, data key, aad) = wrapped key (32 + 16)
    aad       magic | version | master key id | the object's name

The wrap key and the key id both derive (HKDF-SHA256) from the master key, a 32-byte key
in a file every node of a cluster holds (``artifact_key_file``). So: tampering with a
chunk, dropping, reordering or cutting chunks fails that chunk's tag (sealed_state); an
object stored under another name, or an envelope changed in any bit, fails the unwrap;
the chunks of another object fail, being under another data key; and an object sealed
under another master key is named as such by its key id (WrongMasterKey) before any
decryption is tried. Every failure is a NotAuthentic, raised before any unverified
plaintext is yielded. A fresh data key per object means the per-chunk nonces of
sealed_state never repeat under one key, however many objects there are.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from space.node.api import InvalidArgument
from space.node.artifacts._store import (
    ArtifactStore,
    NotAuthentic,
    ObjectInfo,
    WrongMasterKey,
    check_name,
    check_prefix,
)
from space.node.core.keys import KEY_BYTES, load_key
from space.node.vmm.sealed_state import CHUNK_BYTES, Opener, Sealer

__all__ = ["ENVELOPE_BYTES", "MAGIC", "MasterKey", "SealedStore"]

MAGIC = b"\x89SPACEAR"
VERSION = 1
_KEY_ID_BYTES = 8
_NONCE_BYTES = 12
_WRAPPED_BYTES = KEY_BYTES + 16
_ENVELOPE = struct.Struct(f">{len(MAGIC)}sB{_KEY_ID_BYTES}s{_NONCE_BYTES}s{_WRAPPED_BYTES}s")
ENVELOPE_BYTES = _ENVELOPE.size


def _derive(key: bytes, purpose: bytes, length: int) -> bytes:
    return HKDF(algorithm=SHA256(), length=length, salt=None, info=purpose).derive(key)


@dataclass(frozen=True)
class MasterKey:
    """The cluster's artifact master key (never printed): what wraps data keys, and the
    id that names it in every envelope (not secret: derived one way)."""

    wrap_key: bytes = field(repr=False)
    key_id: bytes

    @classmethod
    def from_bytes(cls, key: bytes) -> MasterKey:
        if len(key) != KEY_BYTES:
            raise InvalidArgument(f"a master key is {KEY_BYTES} bytes, got {len(key)}")
        return cls(
            wrap_key=_derive(key, b"space artifact wrap v1", KEY_BYTES),
            key_id=_derive(key, b"space artifact key id v1", _KEY_ID_BYTES),
        )

    @classmethod
    def load(cls, path: Path, *, create: bool = False) -> MasterKey:
        """The key in the owner-only file ``path`` (space.keyfile); with ``create``,
        made first if absent. Raises KeyFileError (InvalidArgument)."""
        return cls.from_bytes(load_key(path, what="artifact master key", create=create))


class SealedStore:
    """An ArtifactStore that seals every object into ``inner`` (module docstring).

    ``list`` and ``head`` give stored (sealed) sizes. A ``get`` verifies as it goes:
    each piece it yields is authentic, and the object is whole only once the iteration
    ended without an error (a cut-off object fails at its end).
    """

    def __init__(
        self, inner: ArtifactStore, master: MasterKey, *, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self.inner = inner
        self._master = master
        self._chunk_bytes = chunk_bytes

    def __repr__(self) -> str:
        return f"SealedStore({self.inner!r}, key id {self._master.key_id.hex()})"

    async def put(self, name: str, pieces: AsyncIterable[bytes]) -> ObjectInfo:
        check_name(name)
        return await self.inner.put(name, self._seal(name, pieces))

    async def _seal(self, name: str, pieces: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        data_key = os.urandom(KEY_BYTES)
        nonce = os.urandom(_NONCE_BYTES)
        aad = _aad(self._master.key_id, name)
        wrapped = AESGCM(self._master.wrap_key).encrypt(nonce, data_key, aad)
        yield _ENVELOPE.pack(MAGIC, VERSION, self._master.key_id, nonce, wrapped)
        out: list[bytes] = []
        sealer = Sealer(data_key, out.append, chunk_bytes=self._chunk_bytes)
        async for piece in pieces:
            await asyncio.to_thread(sealer.update, piece)
            for sealed in out:
                yield sealed
            out.clear()
        sealer.finish()
        for sealed in out:
            yield sealed

    async def get(self, name: str) -> AsyncGenerator[bytes, None]:
        check_name(name)
        async with contextlib.aclosing(self.inner.get(name)) as source:
            envelope = b""
            opener: Opener | None = None
            async for piece in source:
                if opener is None:
                    envelope += piece
                    if len(envelope) < ENVELOPE_BYTES:
                        continue
                    opener = Opener(self._unwrap(name, envelope[:ENVELOPE_BYTES]))
                    piece = envelope[ENVELOPE_BYTES:]
                # Fed no more than completes a chunk at a time, so each verified chunk
                # comes out before a later one in the same piece may fail.
                view = memoryview(piece)
                while view:
                    step, view = bytes(view[: opener.wanted]), view[opener.wanted :]
                    for plaintext in await asyncio.to_thread(_feed, name, opener, step):
                        yield plaintext
        if opener is None:
            raise NotAuthentic(f"artifact {name} is cut short: no whole envelope")
        last = _finish(name, opener)
        if last:
            yield last

    def _unwrap(self, name: str, envelope: bytes) -> bytes:
        magic, version, key_id, nonce, wrapped = _ENVELOPE.unpack(envelope)
        if magic != MAGIC:
            raise NotAuthentic(f"artifact {name} is not a sealed artifact")
        if version != VERSION:
            raise NotAuthentic(f"artifact {name} is of version {version}, not {VERSION}")
        if key_id != self._master.key_id:
            raise WrongMasterKey(
                f"artifact {name} is sealed under master key {key_id.hex()}; this node"
                f" holds {self._master.key_id.hex()} (another cluster's key file?)"
            )
        try:
            return AESGCM(self._master.wrap_key).decrypt(nonce, wrapped, _aad(key_id, name))
        except InvalidTag:
            raise NotAuthentic(
                f"artifact {name}: its data key does not unwrap (tampered, or another object's)"
            ) from None

    async def head(self, name: str) -> ObjectInfo | None:
        return await self.inner.head(check_name(name))

    async def exists(self, name: str) -> bool:
        return await self.inner.exists(check_name(name))

    async def delete(self, name: str) -> None:
        await self.inner.delete(check_name(name))

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self.inner.list(check_prefix(prefix))


def _feed(name: str, opener: Opener, piece: bytes) -> list[bytes]:
    try:
        return opener.feed(piece)
    except NotAuthentic as exc:
        raise NotAuthentic(f"artifact {name} is not authentic: {exc.message}") from None


def _finish(name: str, opener: Opener) -> bytes:
    try:
        return opener.finish()
    except NotAuthentic as exc:
        raise NotAuthentic(f"artifact {name} is not authentic: {exc.message}") from None


def _aad(key_id: bytes, name: str) -> bytes:
    return MAGIC + bytes([VERSION]) + key_id + name.encode()
