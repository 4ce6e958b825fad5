"""Secrets at rest (issue 5): envelope encryption under a keyring of master keys.

Each value is sealed with AES-256-GCM under a random data key of its own (random 96-bit
nonce); the data key is sealed (wrapped) with AES-256-GCM under the keyring's current
master key, with a nonce of its own. Both carry the secret's tenant and name as
associated data, the wrap its master key id too, so a sealed value copied into another
row (another tenant or name) fails to open. Rotating master keys re-wraps data keys
only: values are never re-encrypted, and never written anywhere in plaintext.

Master keys (32 bytes each, written as base64) come from the environment,
SPACE_MASTER_KEY (current; id SPACE_MASTER_KEY_ID, else derived from the key) and
SPACE_OLD_MASTER_KEYS (comma-separated), or else from the key file
(``ControlSettings.key_file``: one key per line, the first current, ``#`` comments),
made with one random key, mode 0600, on first start. Any entry may be written
``ID:BASE64`` to give its id. The newest key wraps; any key in the ring unwraps.

Errors::

    SecretStoreError        root
      MasterKeyError        no usable keyring: missing, malformed, unsafe file
      DecryptionError       a sealed value does not open: its master key is not in the
                            ring, or the row was altered or moved

Messages name secrets, tenants and key ids, never a value or key material.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy.orm import Session

from space.control.settings import ControlSettings
from space.control.store import secrets as stored
from space.control.store.db import migrated
from space.control.store.secrets import Sealed, SecretRecord
from space.keyfile import KeyFileProblem, create_key_file, read_key_file

__all__ = [
    "MASTER_KEY_ENV",
    "MASTER_KEY_ID_ENV",
    "OLD_MASTER_KEYS_ENV",
    "DecryptionError",
    "Keyring",
    "MasterKey",
    "MasterKeyError",
    "SecretStoreError",
    "load_keyring",
    "open_record",
    "rotate",
    "rotate_master",
]

log = logging.getLogger(__name__)

MASTER_KEY_ENV = "SPACE_MASTER_KEY"
MASTER_KEY_ID_ENV = "SPACE_MASTER_KEY_ID"
OLD_MASTER_KEYS_ENV = "SPACE_OLD_MASTER_KEYS"
KEY_BYTES = 32
NONCE_BYTES = 12
_TAG_BYTES = 16
_WRAPPED_BYTES = NONCE_BYTES + KEY_BYTES + _TAG_BYTES
#: A key file is a few lines; anything much larger is not one.
_MAX_KEY_FILE_BYTES = 64 * 1024
_KEY_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class SecretStoreError(Exception):
    """Root of this module's errors."""


class MasterKeyError(SecretStoreError):
    """The keyring cannot be loaded: no key, a malformed entry, an unsafe key file."""


class DecryptionError(SecretStoreError):
    """A sealed value does not open (master key missing from the ring, row altered)."""


@dataclass(frozen=True, slots=True)
class MasterKey:
    key_id: str
    key: bytes = field(repr=False)


def _derived_id(key: bytes) -> str:
    # Domain-separated, so the id is not a plain hash of the key used elsewhere.
    return "mk-" + hashlib.sha256(b"space master key id\0" + key).hexdigest()[:16]


def _parse_entry(text: str, where: str, key_id: str | None = None) -> MasterKey:
    """``[ID:]BASE64`` (base64 has no ':'), as a MasterKey; MasterKeyError naming ``where``."""
    given, colon, encoded = text.strip().rpartition(":")
    if colon:
        key_id = given
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise MasterKeyError(f"{where} is not the base64 of {KEY_BYTES} bytes")
    key_id = key_id or _derived_id(key)
    if not _KEY_ID.fullmatch(key_id):
        raise MasterKeyError(f"{where}: key id {key_id!r} is not 1-64 of [A-Za-z0-9_.-]")
    return MasterKey(key_id, key)


def _aad(kind: bytes, tenant_id: str, name: str, key_id: str = "") -> bytes:
    # Tenant ids, names and key ids hold no NUL (their patterns): the joins are unambiguous.
    return b"\0".join(
        (b"space/" + kind + b"/v1", key_id.encode(), tenant_id.encode(), name.encode())
    )


class Keyring:
    """Master keys, the first current: it wraps new data keys; any key unwraps.

    Raises MasterKeyError for an empty ring or one id given two different keys.
    """

    def __init__(self, keys: Sequence[MasterKey]) -> None:
        if not keys:
            raise MasterKeyError("no master key")
        self._keys: dict[str, MasterKey] = {}
        for key in keys:
            known = self._keys.setdefault(key.key_id, key)
            if known.key != key.key:
                raise MasterKeyError(f"master key id {key.key_id!r} is given two different keys")
        self.current = keys[0]

    def __repr__(self) -> str:
        return f"Keyring(current={self.current.key_id!r}, ids={self.ids!r})"

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self._keys)

    def seal(self, tenant_id: str, name: str, value: str) -> Sealed:
        """``value`` sealed for row (tenant_id, name) under a fresh data key."""
        data_key = AESGCM.generate_key(KEY_BYTES * 8)
        nonce = os.urandom(NONCE_BYTES)
        ciphertext = AESGCM(data_key).encrypt(
            nonce, value.encode(), _aad(b"value", tenant_id, name)
        )
        wrapped = self._wrap(self.current, tenant_id, name, data_key)
        return Sealed(self.current.key_id, wrapped, nonce, ciphertext)

    def open(self, tenant_id: str, name: str, sealed: Sealed) -> str:
        """The value sealed for row (tenant_id, name); DecryptionError if it does not open."""
        data_key = self._unwrap(tenant_id, name, sealed)
        aad = _aad(b"value", tenant_id, name)
        try:
            plain = AESGCM(data_key).decrypt(sealed.nonce, sealed.ciphertext, aad)
            return plain.decode()
        except (InvalidTag, ValueError):
            raise DecryptionError(
                f"secret {name!r} of tenant {tenant_id!r} does not authenticate:"
                " its row was altered or moved"
            ) from None

    def rewrap(self, tenant_id: str, name: str, sealed: Sealed) -> Sealed:
        """``sealed`` with its data key wrapped by the current master key (value untouched)."""
        data_key = self._unwrap(tenant_id, name, sealed)
        wrapped = self._wrap(self.current, tenant_id, name, data_key)
        return Sealed(self.current.key_id, wrapped, sealed.nonce, sealed.ciphertext)

    def _wrap(self, master: MasterKey, tenant_id: str, name: str, data_key: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        aad = _aad(b"data-key", tenant_id, name, master.key_id)
        return nonce + AESGCM(master.key).encrypt(nonce, data_key, aad)

    def _unwrap(self, tenant_id: str, name: str, sealed: Sealed) -> bytes:
        where = f"secret {name!r} of tenant {tenant_id!r}"
        master = self._keys.get(sealed.key_id)
        if master is None:
            raise DecryptionError(
                f"{where} is wrapped by master key {sealed.key_id!r}, which is not in the"
                f" keyring {list(self.ids)} (list it in {OLD_MASTER_KEYS_ENV} or the key file)"
            )
        wrapped = sealed.wrapped_key
        aad = _aad(b"data-key", tenant_id, name, master.key_id)
        try:
            if len(wrapped) != _WRAPPED_BYTES or len(sealed.nonce) != NONCE_BYTES:
                raise ValueError("wrong lengths")
            return AESGCM(master.key).decrypt(wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:], aad)
        except (InvalidTag, ValueError):
            raise DecryptionError(
                f"master key {sealed.key_id!r} does not unwrap the data key of {where}:"
                " a different key under that id, or the row was altered or moved"
            ) from None


def load_keyring(
    settings: ControlSettings, environ: Mapping[str, str] | None = None, *, create: bool = False
) -> Keyring:
    """The master keys of ``environ`` (default os.environ), else of the key file.

    With ``create`` (at startup) a missing key file is made: one random key, mode 0600.
    Raises MasterKeyError for no key (a missing file without ``create``), a malformed
    entry, or a key file others may read or write (group or world permission bits).
    """
    env = os.environ if environ is None else environ
    old = [
        _parse_entry(text, f"{OLD_MASTER_KEYS_ENV} entry {i + 1}")
        for i, text in enumerate(env.get(OLD_MASTER_KEYS_ENV, "").split(","))
        if text.strip()
    ]
    if env.get(MASTER_KEY_ENV):
        given_id = env.get(MASTER_KEY_ID_ENV) or None
        return Keyring([_parse_entry(env[MASTER_KEY_ENV], MASTER_KEY_ENV, given_id), *old])
    path = settings.key_file
    if create:
        _create_key_file(path)
    return Keyring([*_read_key_file(path), *old])


def _create_key_file(path: Path) -> None:
    """Make ``path`` with one random key unless it exists (space/keyfile.py)."""
    if create_key_file(path, base64.b64encode(os.urandom(KEY_BYTES)).decode() + "\n"):
        log.info("made master key file %s", path)


def _read_key_file(path: Path) -> list[MasterKey]:
    try:
        data = read_key_file(path, what="master key file", max_bytes=_MAX_KEY_FILE_BYTES)
    except FileNotFoundError:
        message = f"no master key: {MASTER_KEY_ENV} is unset and {path} is missing"
        raise MasterKeyError(message) from None
    except KeyFileProblem as exc:
        raise MasterKeyError(str(exc)) from None
    lines = data.decode("utf-8", "replace").splitlines()
    keys = [
        _parse_entry(line, f"{path} line {number}")
        for number, line in enumerate(lines, start=1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not keys:
        raise MasterKeyError(f"master key file {path} holds no key")
    return keys


def rotate(session: Session, keyring: Keyring, *, strict: bool = True) -> int:
    """Re-wrap every data key not wrapped by the current master key; returns how many.

    Values are neither re-encrypted nor decrypted (only data keys are unwrapped, in
    memory). A secret replaced or deleted meanwhile is skipped (its new row is already
    under the current key). A data key no key of the ring unwraps raises
    DecryptionError naming the secret (nothing of the transaction is then written),
    or without ``strict`` is logged and left as it is. Once it returns (strict), keys
    other than the current one may be dropped from the ring.
    """
    count = 0
    for record in stored.sealed_by_other_keys(session, keyring.current.key_id):
        try:
            sealed = keyring.rewrap(record.tenant_id, record.name, record.sealed)
        except DecryptionError as exc:
            if strict:
                raise
            log.error("cannot re-wrap: %s", exc)
            continue
        count += stored.replace_sealed(session, record, sealed)
    return count


def rotate_master(settings: ControlSettings) -> tuple[int, str]:
    """Blocking, for the CLI: apply migrations, then ``rotate`` under ``settings``' keyring.

    Returns (data keys re-wrapped, the current master key id). Raises MasterKeyError
    or DecryptionError (nothing written then).
    """
    keyring = load_keyring(settings)
    with migrated(settings.database_url) as db:
        return db.call(lambda session: rotate(session, keyring)), keyring.current.key_id


def open_record(keyring: Keyring, record: SecretRecord) -> str:
    """The value of a stored secret (DecryptionError if it does not open)."""
    return keyring.open(record.tenant_id, record.name, record.sealed)
