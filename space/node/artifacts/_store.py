"""The artifact store's interface, its object names and its errors (issue 19).

An artifact store keeps named, immutable byte objects off the node (a directory, an S3
bucket) so that snapshots and hibernated sandboxes outlive the node that made them. Every
implementation streams: ``put`` takes an async iterable of byte pieces and ``get`` yields
pieces, so no object is ever held whole in memory.

Errors (all of space.node.api's hierarchy)::

    InvalidArgument      a name outside the rules below          (InvalidName)
    NotFound             no such object, or an incomplete bundle  (BundleIncomplete)
    ResourceExhausted    an object larger than the store's bound   (ObjectTooLarge)
    PermissionDenied     the backend refused our credentials
    Unavailable          the backend cannot be reached or failed   (StoreUnavailable)
    └── NotAuthentic     an object that is not what was stored under this master key:
        │                tampered, cut short, another object's, or sealed under another
        │                master key (space.node.vmm.sealed_state.NotAuthentic)
        ├── WrongMasterKey    sealed under a master key this node does not hold
        └── ChecksumMismatch  a bundle part whose bytes are not those its manifest lists

Object names: 1 to ``MAX_NAME_BYTES`` bytes of segments joined by ``/``; a segment (at
most 255 bytes) starts with a letter or digit and holds only letters, digits, ``.``,
``_`` and ``-``. So no
``..``, no leading or trailing ``/``, no empty segment, and no name a backend could take
for a path outside its root or for one of its own temporary files (those start with
``.``).
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, AsyncIterable
from dataclasses import dataclass
from typing import Protocol

from space.node.api import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from space.node.vmm.sealed_state import NotAuthentic

__all__ = [
    "DEFAULT_MAX_OBJECT_BYTES",
    "MAX_LIST_OBJECTS",
    "MAX_NAME_BYTES",
    "READ_BYTES",
    "ArtifactStore",
    "BundleIncomplete",
    "ChecksumMismatch",
    "InvalidName",
    "NotAuthentic",
    "ObjectInfo",
    "ObjectTooLarge",
    "StoreUnavailable",
    "WrongMasterKey",
    "check_name",
    "check_prefix",
]

#: S3 allows 1,024 bytes of key; half leaves room for a bucket-side prefix.
MAX_NAME_BYTES = 512
#: A guest disk stream of a large sandbox fits; a runaway stream does not fill the store.
DEFAULT_MAX_OBJECT_BYTES = 256 << 30
#: The most objects one ``list`` returns (more: ObjectTooLarge, never a silent cut).
MAX_LIST_OBJECTS = 10_000
#: The piece size ``get`` yields: a sealed chunk's worth.
READ_BYTES = 1 << 20

#: A segment is at most 255 bytes, a file name's limit (NAME_MAX) in the filesystem backend.
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}"
_NAME = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")
_PREFIX = re.compile(rf"(?:{_SEGMENT}/)*(?:{_SEGMENT})?")


class InvalidName(InvalidArgument):
    """An object name (or list prefix) outside the store's rules."""


class ObjectTooLarge(ResourceExhausted):
    """An object (or a listing) past the store's bound; nothing of it was kept."""


class StoreUnavailable(Unavailable):
    """The backend could not be reached or failed; the operation may be retried."""


class WrongMasterKey(NotAuthentic):
    """The object was sealed under a master key this node does not hold."""


class ChecksumMismatch(NotAuthentic):
    """A bundle part's bytes are not those its manifest lists (size or SHA-256)."""


class BundleIncomplete(NotFound):
    """A bundle without its manifest, or with a part missing or of the wrong size: it is
    not restorable (yet, or any more)."""


@dataclass(frozen=True)
class ObjectInfo:
    """An object as the store holds it: ``size_bytes`` is the stored size (for a sealed
    store, the sealed size, not the plaintext's)."""

    name: str
    size_bytes: int


def check_name(name: str) -> str:
    """``name`` if it is a valid object name (module docstring); else InvalidName."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidName(f"invalid artifact name {name!r}: segments of [A-Za-z0-9._-]")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise InvalidName(f"artifact name of {len(name.encode())} bytes, over {MAX_NAME_BYTES}")
    return name


def check_prefix(prefix: str) -> str:
    """``prefix`` if it may start object names ("" lists everything); else InvalidName."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise InvalidName(f"invalid artifact name prefix {prefix!r}")
    if len(prefix.encode()) > MAX_NAME_BYTES:
        raise InvalidName(f"artifact name prefix over {MAX_NAME_BYTES} bytes")
    return prefix


class ArtifactStore(Protocol):
    """Named immutable objects, streamed both ways.

    Every method checks names first (InvalidName) and may raise StoreUnavailable or
    PermissionDenied from the backend. A reader never sees half an object: a ``put``
    that fails or is cancelled half-way leaves the name as it was (absent, or the
    previous object).
    """

    async def put(self, name: str, pieces: AsyncIterable[bytes]) -> ObjectInfo:
        """Store the bytes ``pieces`` yields under ``name``, replacing any object there.

        Raises ObjectTooLarge past the store's bound (nothing kept). Holds a bounded
        buffer whatever the object's size.
        """
        ...

    def get(self, name: str) -> AsyncGenerator[bytes, None]:
        """The object's bytes in pieces of at most ``READ_BYTES``; NotFound (at the first
        iteration) if absent. Close it (``contextlib.aclosing``) when stopping early."""
        ...

    async def head(self, name: str) -> ObjectInfo | None:
        """The object, or None if absent."""
        ...

    async def exists(self, name: str) -> bool:
        """Whether the object is there."""
        ...

    async def delete(self, name: str) -> None:
        """Remove the object; idempotent (absent is fine)."""
        ...

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects whose names start with ``prefix``, sorted by name; ObjectTooLarge if
        more than ``MAX_LIST_OBJECTS``."""
        ...
