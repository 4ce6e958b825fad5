"""Guest disks encrypted with QEMU's LUKS driver (space/node/storage/disks.py).

Real ``qemu-img``/``qemu-io`` (installed by scripts/setup.sh); no VM, no root needed.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path

import pytest

from space.node.api import InvalidArgument, Unavailable
from space.node.core.environment import child_environment
from space.node.storage.disks import disk_bytes, disk_format, encrypt_image, grow_disk

PASSPHRASE = b"00" * 32
MARKER = b"plaintext marker that must not be on disk " * 8


def _raw_ext4(tmp_path: Path, mib: int = 16) -> Path:
    image = tmp_path / "raw.img"
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image), f"{mib}M"], check=True)
    with open(image, "r+b") as f:  # in free space, far from the metadata mkfs wrote
        f.seek((mib - 1) << 20)
        f.write(MARKER)
    return image


def _read_decrypted(image: Path, offset: int, length: int, passphrase: bytes) -> bytes:
    """``length`` bytes of the disk the guest would see, read through QEMU's LUKS."""
    out = subprocess.run(
        [
            "qemu-io", "--object", "secret,id=k,file=/dev/stdin,format=raw", "--image-opts",
            f"driver=luks,key-secret=k,file.filename={image}",
            "-c", f"read -v {offset} {length}",
        ],
        input=passphrase, capture_output=True, check=True, env=child_environment(),
    ).stdout.decode()  # fmt: skip
    # "00000400:  83 92 01 fd ...  ....": an offset, up to 16 bytes in hex, their text
    rows = [
        line[11:].split("  ")[0] for line in out.splitlines() if re.match(r"^[0-9a-f]{8}:  ", line)
    ]
    return bytes.fromhex("".join(rows).replace(" ", ""))


def test_an_encrypted_image_holds_no_plaintext_and_reads_back_through_luks(
    tmp_path: Path,
) -> None:
    raw = _raw_ext4(tmp_path)
    luks = tmp_path / "disk.img"
    asyncio.run(encrypt_image(raw, luks, PASSPHRASE))
    assert (disk_format(raw), disk_format(luks)) == ("raw", "luks")
    assert disk_bytes(luks) == disk_bytes(raw) == 16 << 20  # the guest sees the same size
    assert MARKER[:40] in raw.read_bytes() and MARKER[:40] not in luks.read_bytes()
    assert PASSPHRASE not in luks.read_bytes()
    assert _read_decrypted(luks, (15 << 20), 64, PASSPHRASE) == MARKER[:64]
    superblock_magic = _read_decrypted(luks, 1024 + 56, 2, PASSPHRASE)
    assert superblock_magic == b"\x53\xef"  # ext4's, little-endian


def test_an_encrypted_image_is_as_sparse_as_the_raw_one_and_its_filesystem_checks_clean(
    tmp_path: Path,
) -> None:
    raw = _raw_ext4(tmp_path, mib=64)
    luks = tmp_path / "disk.img"
    asyncio.run(encrypt_image(raw, luks, PASSPHRASE))
    # Free space stays holes: at most the header (2 MiB) more than the raw image holds.
    assert luks.stat().st_blocks * 512 <= raw.stat().st_blocks * 512 + (2 << 20)
    plain = tmp_path / "decrypted.img"
    subprocess.run(
        [
            "qemu-img", "convert", "--object", "secret,id=k,file=/dev/stdin,format=raw",
            "--image-opts", f"driver=luks,key-secret=k,file.filename={luks}", "-O", "raw",
            str(plain),
        ],
        input=PASSPHRASE, check=True, env=child_environment(),
    )  # fmt: skip
    assert plain.read_bytes() != raw.read_bytes()  # its holes read as noise
    fsck = subprocess.run(["e2fsck", "-fn", str(plain)], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout  # yet ext4 sees a sound filesystem
    assert _read_decrypted(luks, (63 << 20), 64, PASSPHRASE) == MARKER[:64]


def test_negative_a_wrong_passphrase_does_not_open_the_disk(tmp_path: Path) -> None:
    luks = tmp_path / "disk.img"
    asyncio.run(encrypt_image(_raw_ext4(tmp_path), luks, PASSPHRASE))
    with pytest.raises(subprocess.CalledProcessError) as failed:
        _read_decrypted(luks, 0, 512, b"11" * 32)
    assert b"Invalid password" in failed.value.stderr


def test_growing_an_encrypted_disk_extends_its_payload_sparsely_and_keeps_its_data(
    tmp_path: Path,
) -> None:
    luks = tmp_path / "disk.img"
    asyncio.run(encrypt_image(_raw_ext4(tmp_path), luks, PASSPHRASE))
    allocated = luks.stat().st_blocks
    asyncio.run(grow_disk(luks, 64))
    assert disk_bytes(luks) == 64 << 20
    assert luks.stat().st_blocks == allocated  # a hole: the guest grows its ext4 at boot
    assert _read_decrypted(luks, (15 << 20), 64, PASSPHRASE) == MARKER[:64]
    asyncio.run(grow_disk(luks, 64))  # idempotent
    assert disk_bytes(luks) == 64 << 20
    with pytest.raises(InvalidArgument, match="below the image's 64 MiB"):
        asyncio.run(grow_disk(luks, 63))
    assert disk_bytes(luks) == 64 << 20


def test_a_raw_disk_is_still_grown_with_its_filesystem(tmp_path: Path) -> None:
    raw = _raw_ext4(tmp_path)
    asyncio.run(grow_disk(raw, 32))
    assert disk_bytes(raw) == raw.stat().st_size == 32 << 20
    fsck = subprocess.run(["e2fsck", "-fn", str(raw)], capture_output=True)
    assert fsck.returncode == 0, fsck.stdout
    blocks = subprocess.run(["dumpe2fs", "-h", str(raw)], capture_output=True, text=True)
    assert "Block count:              32768" in blocks.stdout  # 1 KiB blocks: all 32 MiB


def test_negative_a_failed_encryption_says_why(tmp_path: Path) -> None:
    with pytest.raises(Unavailable, match="cannot read the image"):
        asyncio.run(encrypt_image(tmp_path / "missing.img", tmp_path / "out.img", PASSPHRASE))
    with pytest.raises(Unavailable, match="qemu-img"):
        asyncio.run(encrypt_image(_raw_ext4(tmp_path), tmp_path / "no" / "out.img", PASSPHRASE))
    assert not os.path.exists(tmp_path / "out.img")
