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
import os
import struct
from pathlib import Path
from typing import Literal

from space.node.api import InvalidArgument
from space.node.core.run import run

__all__ = ["DiskFormat", "disk_bytes", "disk_format", "encrypt_image", "grow_disk"]

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
    """Write the raw ``source`` as a LUKS image ``dest`` (AES-256-XTS) whose key slot
    opens with ``passphrase``. The passphrase goes to ``qemu-img`` on its stdin, never
    in argv. ``dest`` is fully written (its unwritten sectors would not read as zeros).
    """
    await run(
        "qemu-img", "convert", "-q", "-f", "raw", "-O", "luks",
        "--object", "secret,id=disk-key,file=/dev/stdin,format=raw",
        "-o", f"key-secret=disk-key,iter-time={_ITER_TIME_MS}",
        str(source), str(dest),
        stdin=passphrase.decode(),
        timeout_s=600.0,
    )  # fmt: skip


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
