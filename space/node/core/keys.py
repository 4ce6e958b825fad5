"""The node's keys for data at rest (issue 18): one node key, a subkey per purpose.

The node key is 32 random bytes, kept base64 in ``NodeConfig.effective_key_file``
(default ``<data_dir>/node.key``, mode 0600), made at the node's first start. Losing it
loses every guest disk and saved memory of the node: back it up apart from the data
(or keep the file elsewhere, e.g. on a disk that is not backed up with the pool, and
point ``--node-key-file`` at it). From it, HKDF-SHA256 derives:

- ``disk_passphrase``: the passphrase of the LUKS key slot of every guest disk. A disk
  is a copy-on-write clone of its template's, so all share the volume key LUKS made
  when the base image was imported; the passphrase only unlocks it.
- ``state_key``: the AES-256-GCM key of saved VM states (hibernated sandboxes,
  snapshots, ready states' device state).

Keys are handed to QEMU through the jail (a file in the jail's private root) or a pipe,
never in argv or an environment. Raises KeyFileError (an InvalidArgument) for a missing,
malformed or group/world-readable key file.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from space.keyfile import KeyFileProblem, create_key_file, read_key_file
from space.node.api import InvalidArgument

__all__ = ["KEY_BYTES", "KeyFileError", "NodeKeys", "load_key"]

KEY_BYTES = 32
_MAX_KEY_FILE_BYTES = 4096


class KeyFileError(InvalidArgument):
    """A key file (the node key's, the artifact store's master key's) is missing,
    malformed or readable by others."""


def _derive(key: bytes, purpose: bytes) -> bytes:
    return HKDF(algorithm=SHA256(), length=KEY_BYTES, salt=None, info=purpose).derive(key)


@dataclass(frozen=True)
class NodeKeys:
    """The subkeys of one node key (never printed: ``repr`` shows none of them)."""

    disk_passphrase: bytes = field(repr=False)
    state_key: bytes = field(repr=False)
    #: A fingerprint of the node key, not secret: two nodes with the same one can wake
    #: each other's sandboxes (a move needs it, issue 19).
    key_id: str = ""

    @classmethod
    def from_node_key(cls, node_key: bytes) -> NodeKeys:
        if len(node_key) != KEY_BYTES:
            raise KeyFileError(f"a node key is {KEY_BYTES} bytes, got {len(node_key)}")
        # The passphrase is text (hex) so that qemu-img and QEMU read it alike.
        passphrase = _derive(node_key, b"space disk passphrase v1").hex().encode()
        return cls(
            disk_passphrase=passphrase,
            state_key=_derive(node_key, b"space vm state v1"),
            key_id=_derive(node_key, b"space key id v1")[:8].hex(),
        )

    @classmethod
    def load(cls, path: Path, *, create: bool = False) -> NodeKeys:
        """The keys of the key file at ``path``; with ``create``, made first if absent."""
        return cls.from_node_key(load_key(path, what="node key", create=create))


def load_key(path: Path, *, what: str, create: bool = False) -> bytes:
    """The 32-byte key kept base64 in the owner-only file ``path`` (``what`` names it in
    errors: "node key"); with ``create``, a random one is made there first if absent.

    Raises KeyFileError for a missing, malformed or group/world-readable file.
    """
    if create:
        create_key_file(path, base64.b64encode(os.urandom(KEY_BYTES)).decode() + "\n")
    try:
        data = read_key_file(path, what=f"the {what} file", max_bytes=_MAX_KEY_FILE_BYTES)
    except FileNotFoundError:
        raise KeyFileError(f"cannot open the {what} file {path}: it is missing") from None
    except KeyFileProblem as exc:
        raise KeyFileError(str(exc)) from None
    try:
        key = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise KeyFileError(f"the {what} file {path} is not one base64 key") from None
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"the {what} in {path} is {len(key)} bytes, not {KEY_BYTES}")
    return key
