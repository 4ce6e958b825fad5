"""Guest disk images: encrypted with QEMU's LUKS driver, grown without the host parsing them.

Every guest disk of a node is LUKS (issue 18): the base image is encrypted once, as it
is imported into the pool, under the node's disk passphrase (space/node/core/keys.py),
and every template, layer, sandbox volume and snapshot is a copy-on-write clone of it.
LUKS encrypts each sector under the volume key with the sector's number as its IV, so
clones share every extent neither has written, as raw images did. Only QEMU (jailed)
and ``qemu-img`` (at import) ever see the plaintext.

A disk is grown by extending its file: the LUKS payload is what follows the header, so
the guest sees a larger device and grows its ext4 itself as it boots
(space/guest/init.py), never the host. A raw image (a data dir from before encryption,
or a tool's disk made without keys) still works, grown with resize2fs as before.

Raises space.node.api leaves: Unavailable for a failed command, InvalidArgument for a
size below the image's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from pathlib import Path
from typing import Literal

from space.node.api import InvalidArgument, Unavailable
from space.node.core.run import run

__all__ = [
    "DiskFormat",
    "decrypted_copy",
    "disk_bytes",
    "disk_format",
    "encrypt_image",
    "grow_disk",
]

DiskFormat = Literal["raw", "luks"]

_LUKS_MAGIC = b"LUKS\xba\xbe"
_PAYLOAD_OFFSET_AT = 104  # LUKS1 header: payload offset, in 512-byte sectors, big-endian
#: PBKDF2 time for the key slot. The passphrase is a random 256-bit key (not a
#: password), so stretching adds nothing but start time: 1 ms is ~4,000 iterations,
#: where QEMU's default of 2 s would add two seconds to every VM start.
_ITER_TIME_MS = 1


def disk_format(image: Path) -> DiskFormat:
    """``luks`` if ``image`` starts with a LUKS header, else ``raw``."""
    with open(image, "rb") as f:
        return "luks" if f.read(len(_LUKS_MAGIC)) == _LUKS_MAGIC else "raw"


def _payload_offset(image: Path) -> int:
    """Bytes before a disk's payload (its LUKS header and key material; 0 for raw)."""
    with open(image, "rb") as f:
        header = f.read(_PAYLOAD_OFFSET_AT + 4)
    if not header.startswith(_LUKS_MAGIC):
        return 0
    (sectors,) = struct.unpack_from(">I", header, _PAYLOAD_OFFSET_AT)
    return int(sectors) * 512


def disk_bytes(image: Path) -> int:
    """The size of the disk the guest sees (the file less any LUKS header)."""
    return image.stat().st_size - _payload_offset(image)


async def encrypt_image(source: Path, dest: Path, passphrase: bytes) -> None:
    """Write the raw ext4 image ``source`` as a LUKS image ``dest`` (AES-256-XTS) whose
    key slot opens with ``passphrase``, handed to ``qemu-img`` on its stdin (never argv).

    Runs of 1 MiB or more of zeros are left as holes, which decrypt to noise, not
    zeros. In an ext4 image they are free space, or metadata ext4 never reads before
    it writes (unused inode table slots, a clean journal's unused blocks); file data
    holds no such runs (``mkfs.ext4 -d`` stores zero blocks as holes). Sparse, the
    image stays as small as the raw one: written dense, every clone would reference
    all of it, since btrfs keeps a whole extent referenced while any part of it is.
    """
    try:
        size = (await asyncio.to_thread(os.stat, source)).st_size
    except OSError as exc:
        raise Unavailable(f"cannot read the image {source}: {exc.strerror}") from exc
    secret = ["--object", "secret,id=disk-key,file=/dev/stdin,format=raw"]
    await run(
        "qemu-img", "create", "-q", "-f", "luks", *secret,
        "-o", f"key-secret=disk-key,iter-time={_ITER_TIME_MS}", str(dest), str(size),
        stdin=passphrase.decode(),
    )  # fmt: skip
    try:
        await run(
            "qemu-img", "convert", "-q", "-n", "--target-is-zero", "-S", "1M", "-f", "raw",
            *secret, "--target-image-opts", str(source),
            f"driver=luks,key-secret=disk-key,file.filename={dest}",
            stdin=passphrase.decode(), timeout_s=600.0,
        )  # fmt: skip
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dest)  # never a half-written disk
        raise


async def decrypted_copy(image: Path, directory: Path, passphrase: bytes) -> int:
    """The plaintext of the LUKS image ``image``, in a file of ``directory`` that has no
    name, open (read and write; the caller closes it, which frees it). A file without
    a name is readable only through this process's descriptor and is gone with it,
    also after a crash, where a named copy would stay behind.

    Only what the image holds is decrypted: its holes (free space, see
    ``encrypt_image``) decrypt to noise, which would cost the whole disk's size in
    writes, so they stay holes here and read as zeros (smaller ones are decrypted, so
    qemu-img is given at most ``_MAX_SOURCES`` pieces). Raises Unavailable (qemu-img
    failed, or no room).
    """
    offset = await asyncio.to_thread(_payload_offset, image)
    pieces = await asyncio.to_thread(_pieces, image, offset)
    key = "key-secret=disk-key"
    name = str(image).replace(",", ",,")  # a comma ends an option
    sources = [
        f"driver=raw,offset={start},size={length},file.driver=luks,file.{key},"
        f"file.file.driver=file,file.file.filename={name}"
        if data
        else f"driver=null-co,size={length},read-zeroes=on"
        for start, length, data in pieces
    ]
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, sum(length for _, length, _ in pieces))
        await run(
            "qemu-img", "convert", "-q", "-U", "-n", "--target-is-zero",
            "--object", "secret,id=disk-key,file=/dev/stdin,format=raw",
            "--image-opts", *sources, "-O", "raw", f"/proc/self/fd/{fd}",
            stdin=passphrase.decode(), timeout_s=600.0, pass_fds=(fd,),
        )  # fmt: skip
    except BaseException:
        os.close(fd)
        raise
    return fd


#: The most pieces a decrypted copy is made of (each a source qemu-img opens).
_MAX_SOURCES = 256


def _pieces(image: Path, offset: int) -> list[tuple[int, int, bool]]:
    """The payload of ``image`` as (start, length, holds data) pieces, in order, where
    holes of less than 1 MiB (or a 128th of the disk) count as data."""
    with open(image, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        min_hole = max(1 << 20, (end - offset) // (_MAX_SOURCES // 2))
        pieces: list[tuple[int, int, bool]] = []
        position = offset
        while position < end:
            try:
                data = os.lseek(f.fileno(), position, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                data = end
            start = position  # a small hole is decrypted with the data after it
            if data > position and (data - position >= min_hole or data == end):
                pieces.append((position - offset, data - position, False))
                start = data
            if data >= end:
                break
            hole = min(os.lseek(f.fileno(), data, os.SEEK_HOLE), end)
            if pieces and pieces[-1][2]:  # the data before a small hole: one piece
                start = pieces.pop()[0] + offset
            pieces.append((start - offset, hole - start, True))
            position = hole
    return pieces


async def grow_disk(image: Path, disk_mib: int) -> None:
    """Make the disk the guest sees ``disk_mib`` MiB (never shrinks it).

    Only for an image no guest has written to yet. A LUKS image's file is extended (its
    guest grows the filesystem as it boots); a raw one's ext4 is grown by resize2fs.
    """
    offset = await asyncio.to_thread(_payload_offset, image)
    if await asyncio.to_thread(_extend_file, image, offset, disk_mib << 20) and offset == 0:
        await run("resize2fs", "-f", str(image), timeout_s=120.0)


def _extend_file(path: Path, offset: int, size: int) -> bool:
    """Grow ``path`` (sparse) so its payload is ``size`` bytes; False if it already is."""
    current = path.stat().st_size - offset
    if size < current:
        raise InvalidArgument(f"disk of {size >> 20} MiB is below the image's {current >> 20} MiB")
    if size == current:
        return False
    os.truncate(path, offset + size)
    return True
