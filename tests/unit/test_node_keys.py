"""The node key file and the keys derived from it (space/node/core/keys.py)."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from space.node.core.keys import KeyFileError, NodeKeys


def test_the_key_file_is_made_once_owner_only_and_gives_the_same_keys_each_load(
    tmp_path: Path,
) -> None:
    path = tmp_path / "data" / "node.key"
    first = NodeKeys.load(path, create=True)
    assert path.stat().st_mode & 0o777 == 0o600
    assert len(base64.b64decode(path.read_text().strip())) == 32
    again = NodeKeys.load(path, create=True)
    assert (again.disk_passphrase, again.state_key) == (first.disk_passphrase, first.state_key)
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]  # no temporary left


def test_each_purpose_gets_its_own_key_and_no_key_is_shown(tmp_path: Path) -> None:
    keys = NodeKeys.from_node_key(os.urandom(32))
    assert len(keys.state_key) == 32
    assert len(keys.disk_passphrase) == 64 and bytes.fromhex(keys.disk_passphrase.decode())
    assert bytes.fromhex(keys.disk_passphrase.decode()) != keys.state_key
    other = NodeKeys.from_node_key(os.urandom(32))
    assert other.state_key != keys.state_key
    assert keys.state_key.hex() not in repr(keys) and "passphrase=" not in repr(keys)


def test_negative_a_missing_key_file_is_not_made_without_create(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="cannot open"):
        NodeKeys.load(tmp_path / "node.key")
    assert not (tmp_path / "node.key").exists()


@pytest.mark.parametrize(
    ("content", "mode", "message"),
    [
        (base64.b64encode(bytes(32)) + b"\n", 0o640, "open to group or others"),
        (b"not base64!\n", 0o600, "not one base64 key"),
        (base64.b64encode(bytes(16)) + b"\n", 0o600, "16 bytes, not 32"),
        (b"A" * 5000, 0o600, "larger than 4096 bytes"),
    ],
)
def test_negative_an_unsafe_or_malformed_key_file_is_refused(
    tmp_path: Path, content: bytes, mode: int, message: str
) -> None:
    path = tmp_path / "node.key"
    path.write_bytes(content)
    path.chmod(mode)
    with pytest.raises(KeyFileError, match=message):
        NodeKeys.load(path, create=True)
    assert path.read_bytes() == content  # never replaced


def test_negative_a_link_in_place_of_the_key_file_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text(base64.b64encode(bytes(32)).decode())
    target.chmod(0o600)
    (tmp_path / "node.key").symlink_to(target)
    with pytest.raises(KeyFileError, match="cannot open"):
        NodeKeys.load(tmp_path / "node.key")
