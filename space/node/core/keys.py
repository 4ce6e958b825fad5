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
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from space.node.api import InvalidArgument

__all__ = ["KEY_BYTES", "KeyFileError", "NodeKeys"]

KEY_BYTES = 32
_MAX_KEY_FILE_BYTES = 4096


class KeyFileError(InvalidArgument):
    """The node key file is missing, malformed or readable by others."""


def _derive(key: bytes, purpose: bytes) -> bytes:
    return HKDF(algorithm=SHA256(), length=KEY_BYTES, salt=None, info=purpose).derive(key)


@dataclass(frozen=True)
class NodeKeys:
    """The subkeys of one node key (never printed: ``repr`` shows none of them)."""

    disk_passphrase: bytes = field(repr=False)
    state_key: bytes = field(repr=False)

    @classmethod
    def from_node_key(cls, node_key: bytes) -> NodeKeys:
        if len(node_key) != KEY_BYTES:
            raise KeyFileError(f"a node key is {KEY_BYTES} bytes, got {len(node_key)}")
        # The passphrase is text (hex) so that qemu-img and QEMU read it alike.
        passphrase = _derive(node_key, b"space disk passphrase v1").hex().encode()
        return cls(disk_passphrase=passphrase, state_key=_derive(node_key, b"space vm state v1"))

    @classmethod
    def load(cls, path: Path, *, create: bool = False) -> NodeKeys:
        """The keys of the key file at ``path``; with ``create``, made first if absent."""
        if create:
            _create_key_file(path)
        return cls.from_node_key(_read_key_file(path))


def _create_key_file(path: Path) -> None:
    """Make ``path`` with a random key unless it exists; atomic (link of a full file)."""
    if path.exists():
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(base64.b64encode(os.urandom(KEY_BYTES)).decode() + "\n")
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            return  # made meanwhile by another process: theirs is the key
    finally:
        temporary.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _read_key_file(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise KeyFileError(f"cannot open the node key file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"the node key file {path} is not a regular file")
        if info.st_mode & 0o077:
            raise KeyFileError(
                f"the node key file {path} is open to group or others"
                f" (mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it"
            )
        data = file.read(_MAX_KEY_FILE_BYTES + 1)
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"the node key file {path} is over {_MAX_KEY_FILE_BYTES} bytes")
    try:
        key = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise KeyFileError(f"the node key file {path} is not one base64 key") from None
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"the node key in {path} is {len(key)} bytes, not {KEY_BYTES}")
    return key
