"""Saved VM states sealed at rest (issue 18): an authenticated streaming format.

A sealed state is a header, then the plaintext (QEMU's migration stream) cut into
chunks of ``chunk_bytes``, each sealed alone with AES-256-GCM (the STREAM construction
of Hoang, Reyhanitabar, Rogaway and Vizár, as in Tink's streaming AEAD)::

    header   magic (8) | version (1) | chunk_bytes (4, big endian) | nonce prefix (7)
    chunk i  AES-256-GCM(key, nonce_i, plaintext_i, aad=header) = ciphertext_i | tag (16)
    nonce_i  nonce prefix (7) | i (4, big endian) | 1 if the last chunk else 0 (1)

Every chunk but the last holds exactly ``chunk_bytes`` of plaintext; the last holds
what is left (0 to ``chunk_bytes``; a chunk of 0 only for an empty stream). Each chunk's
place is in its nonce and the header is the associated data of every chunk, so a
flipped bit anywhere, chunks reordered, dropped or duplicated, the stream cut short
(its last chunk then was not sealed as the last) or data after the last chunk all fail
authentication. A random nonce prefix per state keeps nonces unique under one key.

Both directions stream in constant memory (two chunks at most); a reader checks the
header's chunk size against ``MAX_CHUNK_BYTES`` before it allocates anything. Opening
yields a chunk's plaintext only once its tag verified. Raises NotAuthentic (an
Unavailable) for anything that is not a whole, authentic stream under the key.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from space.node.api import Unavailable

__all__ = [
    "CHUNK_BYTES",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_CHUNK_BYTES",
    "NotAuthentic",
    "Opener",
    "Sealer",
    "is_sealed",
    "open_chunks",
]

#: No QEMU migration stream starts so (those start "QEVM"), so a file without it is a
#: plaintext state written before states were sealed.
MAGIC = b"\x89SPACEST"
VERSION = 1
#: 1 MiB: the tag and the nonce cost 16 bytes in a MiB, and a thread seals one in about
#: a millisecond, so the pipe to QEMU never waits long on a chunk.
CHUNK_BYTES = 1 << 20
#: The largest chunk a reader accepts from a header (what it may have to allocate).
MAX_CHUNK_BYTES = 16 << 20
TAG_BYTES = 16
_PREFIX_BYTES = 7
_HEADER = struct.Struct(f">{len(MAGIC)}sBI{_PREFIX_BYTES}s")
HEADER_BYTES = _HEADER.size
_MAX_CHUNKS = 1 << 32  # the nonce's 4-byte counter

Read = Callable[[int], bytes]
Write = Callable[[bytes], object]


class NotAuthentic(Unavailable):
    """The stream is not a whole, authentic sealed state under this key."""


def is_sealed(head: bytes) -> bool:
    """True iff ``head`` (a file's first bytes, at least ``len(MAGIC)``) starts a sealed
    state."""
    return head.startswith(MAGIC)


def _nonce(prefix: bytes, index: int, last: bool) -> bytes:
    if index >= _MAX_CHUNKS:
        raise NotAuthentic(f"over {_MAX_CHUNKS} chunks")
    return prefix + index.to_bytes(4, "big") + (b"\x01" if last else b"\x00")


class Sealer:
    """Seals a stream written in pieces of any size into ``write``.

    ``write`` gets the header at once, then each chunk as soon as it is known not to be
    the last one; ``finish`` seals the last. Until ``finish`` the output is no whole
    state (a reader refuses it), so a save that fails half-way never authenticates.
    Holds one chunk's buffer, whatever the pieces.
    """

    def __init__(self, key: bytes, write: Write, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, not {chunk_bytes}")
        self._aead = AESGCM(key)
        self._write = write
        self._chunk_bytes = chunk_bytes
        self._prefix = os.urandom(_PREFIX_BYTES)
        self._header = _HEADER.pack(MAGIC, VERSION, chunk_bytes, self._prefix)
        # One chunk's buffer, filled in place: appending to a growing bytearray and
        # cutting chunks off its front cost 8x the AES itself with a pipe's 64 KiB reads.
        self._buffer = bytearray(chunk_bytes)
        self._filled = 0
        self._index = 0
        self._finished = False
        write(self._header)

    def update(self, data: bytes) -> None:
        """Add ``data`` to the stream; writes every chunk that is complete and not last."""
        if self._finished:
            raise ValueError("the stream is finished")
        view = memoryview(data)
        while view:
            if self._filled == self._chunk_bytes:  # full, and more follows: not the last
                self._seal(bytes(self._buffer), last=False)
                self._filled = 0
            taken = min(self._chunk_bytes - self._filled, len(view))
            self._buffer[self._filled : self._filled + taken] = view[:taken]
            self._filled += taken
            view = view[taken:]

    def finish(self) -> None:
        """Seal what is left as the last chunk (an empty one for an empty stream)."""
        if self._finished:
            raise ValueError("the stream is finished")
        self._finished = True
        self._seal(bytes(self._buffer[: self._filled]), last=True)

    def _seal(self, plaintext: bytes, *, last: bool) -> None:
        nonce = _nonce(self._prefix, self._index, last)
        self._write(self._aead.encrypt(nonce, plaintext, self._header))
        self._index += 1


class Opener:
    """Opens a sealed stream fed in pieces of any size (no I/O of its own), so a thread
    reading a file and a coroutine reading a network stream share one reader.

    ``feed`` returns the plaintext of every chunk known to be complete and not the last
    one (a full chunk followed by at least one more byte), each verified; ``finish``
    opens what is left as the last chunk. Raises NotAuthentic at the first thing that
    does not authenticate (the header included, checked before anything of its chunk
    size is held). Holds at most one sealed chunk plus the piece being fed.
    """

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._buffer = bytearray()
        self._header = b""
        self._sealed_bytes = 0
        self._prefix = b""
        self._index = 0
        self._finished = False

    @property
    def wanted(self) -> int:
        """How many more bytes make the next step possible (at least 1): a reader that
        reads this much at a time never holds more than a chunk."""
        if not self._header:
            return max(1, HEADER_BYTES - len(self._buffer))
        return max(1, self._sealed_bytes + 1 - len(self._buffer))

    def feed(self, data: bytes) -> list[bytes]:
        """Take the next ``data``; the verified plaintext of the chunks it completes."""
        if self._finished:
            raise ValueError("the stream is finished")
        self._buffer += data
        if not self._header:
            if len(self._buffer) < HEADER_BYTES:
                return []
            header = bytes(self._buffer[:HEADER_BYTES])
            chunk_bytes, self._prefix = _parse_header(header)
            self._header, self._sealed_bytes = header, chunk_bytes + TAG_BYTES
            del self._buffer[:HEADER_BYTES]
        out: list[bytes] = []
        while len(self._buffer) > self._sealed_bytes:  # a full chunk and more: not the last
            out.append(self._open(bytes(self._buffer[: self._sealed_bytes]), last=False))
            del self._buffer[: self._sealed_bytes]
        return out

    def finish(self) -> bytes:
        """The verified plaintext of the last chunk (empty for an empty stream). Raises
        NotAuthentic for a stream cut short or one that went on after its last chunk."""
        if self._finished:
            raise ValueError("the stream is finished")
        self._finished = True
        if not self._header:
            raise NotAuthentic("no sealed-state header")
        last = bytes(self._buffer)
        self._buffer = bytearray()
        return self._open(last, last=True)

    def _open(self, sealed: bytes, *, last: bool) -> bytes:
        nonce = _nonce(self._prefix, self._index, last)
        try:
            plaintext = self._aead.decrypt(nonce, sealed, self._header)
        except InvalidTag:
            raise NotAuthentic(_what_failed(self._index, last, len(sealed))) from None
        self._index += 1
        return plaintext


def open_chunks(key: bytes, read: Read) -> Iterator[bytes]:
    """Yield the plaintext of the sealed stream ``read`` gives, one verified chunk at a
    time (the last may be empty).

    ``read(n)`` returns up to ``n`` bytes, ``b""`` at the end. Raises NotAuthentic,
    before yielding anything unverified, at the first thing that does not authenticate
    (the header included) and for a stream that ends without its last chunk or goes on
    after it. Stopping the iteration early is safe: nothing is buffered but a chunk.
    """
    opener = Opener(key)
    while piece := read(opener.wanted):
        yield from opener.feed(piece)
    yield opener.finish()


def _parse_header(header: bytes) -> tuple[int, bytes]:
    if len(header) < HEADER_BYTES or not is_sealed(header):
        raise NotAuthentic("no sealed-state header")
    _magic, version, chunk_bytes, prefix = _HEADER.unpack(header)
    if version != VERSION:
        raise NotAuthentic(f"sealed-state version {version}, this node reads {VERSION}")
    # Checked before anything of that size is read or allocated.
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise NotAuthentic(f"chunk size {chunk_bytes} outside 1..{MAX_CHUNK_BYTES}")
    return chunk_bytes, prefix


def _what_failed(index: int, last: bool, length: int) -> str:
    if length < TAG_BYTES:
        return f"chunk {index} is cut short ({length} bytes)"
    where = "the last chunk" if last else "a chunk followed by more"
    return f"chunk {index} ({where}, {length} bytes) fails its tag"
