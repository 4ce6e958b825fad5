"""Secrets at rest (space.control.secrets): envelope encryption, keyrings, rotation."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from space.control.secrets import (
    MASTER_KEY_ENV,
    MASTER_KEY_ID_ENV,
    OLD_MASTER_KEYS_ENV,
    DecryptionError,
    Keyring,
    MasterKey,
    MasterKeyError,
    load_keyring,
    rotate,
    rotate_master,
)
from space.control.settings import ControlSettings
from space.control.store import Database
from space.control.store import secrets as stored
from space.control.store.models import TenantRow
from space.control.store.secrets import Sealed, SecretRecord

VALUE = "sk-live-4f9c1e-do-not-leak"
OLD = MasterKey("old", bytes(range(32)))
NEW = MasterKey("new", bytes(range(32, 64)))


def _flip(data: bytes, index: int = 0) -> bytes:
    return data[:index] + bytes([data[index] ^ 1]) + data[index + 1 :]


def _b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


def test_a_sealed_value_opens_to_itself_and_holds_no_plaintext() -> None:
    ring = Keyring([NEW])
    sealed = ring.seal("acme", "OPENAI_KEY", VALUE)
    assert ring.open("acme", "OPENAI_KEY", sealed) == VALUE
    assert sealed.key_id == "new" and len(sealed.nonce) == 12 and len(sealed.wrapped_key) == 60
    assert VALUE.encode() not in sealed.ciphertext + sealed.wrapped_key


def test_sealing_twice_uses_fresh_data_keys_and_nonces() -> None:
    ring = Keyring([NEW])
    first, second = ring.seal("t", "N", VALUE), ring.seal("t", "N", VALUE)
    assert first.ciphertext != second.ciphertext and first.nonce != second.nonce
    assert first.wrapped_key != second.wrapped_key


@pytest.mark.parametrize("part", ["ciphertext", "wrapped_key", "nonce"])
@pytest.mark.parametrize("index", [0, -1])
def test_negative_a_flipped_bit_anywhere_does_not_open(part: str, index: int) -> None:
    ring = Keyring([NEW])
    sealed = ring.seal("acme", "N", VALUE)
    data: bytes = getattr(sealed, part)
    flipped = _flip(data, index % len(data))
    tampered = Sealed(**{**{f: getattr(sealed, f) for f in Sealed.__slots__}, part: flipped})
    with pytest.raises(DecryptionError) as caught:
        ring.open("acme", "N", tampered)
    assert VALUE not in str(caught.value) and "'N'" in str(caught.value)


@pytest.mark.parametrize(("tenant", "name"), [("other", "N"), ("acme", "M")])
def test_negative_a_value_moved_to_another_tenant_or_name_does_not_open(
    tenant: str, name: str
) -> None:
    ring = Keyring([NEW])
    sealed = ring.seal("acme", "N", VALUE)
    with pytest.raises(DecryptionError, match="altered or moved"):
        ring.open(tenant, name, sealed)


def test_negative_a_master_key_missing_from_the_ring_is_named() -> None:
    sealed = Keyring([OLD]).seal("acme", "N", VALUE)
    with pytest.raises(DecryptionError, match=r"master key 'old', which is not in the keyring"):
        Keyring([NEW]).open("acme", "N", sealed)


def test_negative_another_key_under_the_same_id_is_a_clear_error() -> None:
    sealed = Keyring([OLD]).seal("acme", "N", VALUE)
    impostor = MasterKey("old", bytes(32))
    with pytest.raises(DecryptionError, match="a different key under that id"):
        Keyring([impostor]).open("acme", "N", sealed)


def test_negative_one_id_with_two_keys_is_not_a_keyring() -> None:
    with pytest.raises(MasterKeyError, match="given two different keys"):
        Keyring([OLD, MasterKey("old", bytes(32))])
    with pytest.raises(MasterKeyError):
        Keyring([])


def test_the_key_is_not_in_a_keys_repr() -> None:
    assert "key=" not in repr(OLD) and str(bytes(range(32))) not in repr(Keyring([OLD]))


# -- rotation, on a database ---------------------------------------------------------


def _database(tmp_path: Path) -> Database:
    db = Database(f"sqlite:///{tmp_path / 'space.db'}")
    db.upgrade()
    db.call(lambda s: s.add(TenantRow(id="acme", created_at=0.0)))
    return db


def _store(db: Database, ring: Keyring, name: str) -> None:
    sealed = ring.seal("acme", name, VALUE + name)
    record = SecretRecord("acme", name, ("a.example",), name, "placeholder", None,
                          "{value}", sealed, 1.0, 1.0)  # fmt: skip
    db.call(lambda s: stored.upsert_secret(s, record))


def test_rotation_rewraps_data_keys_only_and_the_old_key_can_then_go(tmp_path: Path) -> None:
    db = _database(tmp_path)
    try:
        _store(db, Keyring([OLD]), "A")
        _store(db, Keyring([OLD]), "B")
        before = db.call(lambda s: stored.find_secret(s, "acme", "A"))
        assert before is not None
        assert db.call(lambda s: rotate(s, Keyring([NEW, OLD]))) == 2
        assert db.call(lambda s: rotate(s, Keyring([NEW, OLD]))) == 0  # nothing stale left
        after = db.call(lambda s: stored.find_secret(s, "acme", "A"))
        assert after is not None and after.sealed.key_id == "new"
        assert (after.sealed.ciphertext, after.sealed.nonce) == (
            before.sealed.ciphertext, before.sealed.nonce
        )  # fmt: skip
        assert Keyring([NEW]).open("acme", "A", after.sealed) == VALUE + "A"
    finally:
        db.dispose()


def test_negative_strict_rotation_with_a_missing_key_writes_nothing(tmp_path: Path) -> None:
    db = _database(tmp_path)
    try:
        _store(db, Keyring([OLD]), "A")
        _store(db, Keyring([MasterKey("lost", bytes(32))]), "B")
        with pytest.raises(DecryptionError, match="'lost'"):
            db.call(lambda s: rotate(s, Keyring([NEW, OLD])))
        ids = {r.sealed.key_id for r in db.call(lambda s: stored.list_secrets(s, "acme"))}
        assert ids == {"old", "lost"}
        assert db.call(lambda s: rotate(s, Keyring([NEW, OLD]), strict=False)) == 1
    finally:
        db.dispose()


def test_negative_rotation_skips_a_secret_replaced_meanwhile(tmp_path: Path) -> None:
    db = _database(tmp_path)
    try:
        _store(db, Keyring([OLD]), "A")
        stale = db.call(lambda s: stored.find_secret(s, "acme", "A"))
        assert stale is not None
        _store(db, Keyring([NEW]), "A")  # a PUT between rotation's read and its write
        rewrapped = Keyring([NEW, OLD]).rewrap("acme", "A", stale.sealed)
        assert db.call(lambda s: stored.replace_sealed(s, stale, rewrapped)) is False
        current = db.call(lambda s: stored.find_secret(s, "acme", "A"))
        assert current is not None and Keyring([NEW]).open("acme", "A", current.sealed)
    finally:
        db.dispose()


# -- loading keyrings ----------------------------------------------------------------


def test_first_start_makes_a_private_key_file_and_later_loads_read_it(tmp_path: Path) -> None:
    settings = ControlSettings(data_dir=tmp_path)
    made = load_keyring(settings, {}, create=True)
    assert settings.key_file == tmp_path / "master.key"
    assert os.stat(settings.key_file).st_mode & 0o777 == 0o600
    again = load_keyring(settings, {})
    assert again.current == made.current and made.current.key_id.startswith("mk-")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o620])
def test_negative_a_key_file_open_to_group_or_others_is_refused(tmp_path: Path, mode: int) -> None:
    settings = ControlSettings(data_dir=tmp_path)
    load_keyring(settings, {}, create=True)
    settings.key_file.chmod(mode)
    with pytest.raises(MasterKeyError, match=f"mode {mode:04o}.*chmod 600"):
        load_keyring(settings, {}, create=True)


def test_negative_without_create_a_missing_key_file_is_not_made(tmp_path: Path) -> None:
    settings = ControlSettings(data_dir=tmp_path)
    with pytest.raises(MasterKeyError, match="no master key"):
        load_keyring(settings, {})
    assert not settings.key_file.exists()


def test_a_key_file_lists_the_current_key_first_then_old_ones(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# rotated\n{_b64(NEW.key)}\n\nold:{_b64(OLD.key)}\n")
    path.chmod(0o600)
    ring = load_keyring(ControlSettings(data_dir=tmp_path, master_key_file=path), {})
    assert ring.current.key == NEW.key and "old" in ring.ids and len(ring.ids) == 2


def test_the_environment_wins_over_the_key_file_and_names_its_keys(tmp_path: Path) -> None:
    env = {MASTER_KEY_ENV: _b64(NEW.key), MASTER_KEY_ID_ENV: "k2026",
           OLD_MASTER_KEYS_ENV: f"{_b64(OLD.key)}, k2025:{_b64(bytes(32))}"}  # fmt: skip
    ring = load_keyring(ControlSettings(data_dir=tmp_path), env, create=True)
    assert ring.current == MasterKey("k2026", NEW.key)
    assert ring.ids[2] == "k2025" and ring.ids[1].startswith("mk-")
    assert not (tmp_path / "master.key").exists()


@pytest.mark.parametrize("bad", ["not base64!", _b64(bytes(31)), _b64(bytes(33))])
def test_negative_a_malformed_key_is_refused_without_echoing_it(tmp_path: Path, bad: str) -> None:
    with pytest.raises(MasterKeyError) as caught:
        load_keyring(ControlSettings(data_dir=tmp_path), {MASTER_KEY_ENV: bad})
    assert bad not in str(caught.value) and MASTER_KEY_ENV in str(caught.value)


def test_rotate_master_moves_every_secret_to_the_current_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = _database(tmp_path)
    try:
        _store(db, Keyring([OLD]), "A")
    finally:
        db.dispose()
    monkeypatch.setenv(MASTER_KEY_ENV, f"new:{_b64(NEW.key)}")
    monkeypatch.setenv(OLD_MASTER_KEYS_ENV, f"old:{_b64(OLD.key)}")
    assert rotate_master(ControlSettings(data_dir=tmp_path)) == (1, "new")
    assert rotate_master(ControlSettings(data_dir=tmp_path)) == (0, "new")


def test_sealed_is_stored_as_bytes_without_the_value(tmp_path: Path) -> None:
    db = _database(tmp_path)
    try:
        _store(db, Keyring([NEW]), "A")
    finally:
        db.dispose()
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("space.db*"))
    assert VALUE.encode() not in raw and b"sk-live" not in raw
