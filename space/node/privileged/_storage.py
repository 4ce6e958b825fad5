"""The pool's root operations: loop mounts, quotas, limits, sizes, subvolume deletion.

What btrfs lets a subvolume's owner do (make a subvolume, snapshot it, make it
read-only) the node agent does itself (space.node.storage.btrfs); this is the rest.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import struct
from pathlib import Path

from space.node.api import Unavailable
from space.node.core.ownership import adopt_tree
from space.node.core.run import run
from space.node.vmm.jail import JAIL_UIDS

__all__ = [
    "adopt_pool",
    "delete_subvolume",
    "enable_quotas",
    "exclusive_bytes",
    "limit_subvolume",
    "mount_pool",
    "referenced_bytes",
    "unmount_pool",
]

#: BTRFS_IOC_QGROUP_LIMIT = _IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args) (linux/btrfs.h).
_QGROUP_LIMIT = 0x8030942B
_LIMIT_MAX_RFER = 1 << 0
#: struct btrfs_ioctl_qgroup_limit_args: u64 qgroupid (0: the subvolume of the fd), then
#: struct btrfs_qgroup_limit: u64 flags, max_rfer, max_excl, rsv_rfer, rsv_excl.
_QGROUP_LIMIT_ARGS = struct.Struct("=6Q")


async def mount_pool(image: Path, mountpoint: Path, *, mkfs: bool, owner: tuple[int, int]) -> None:
    """Loop-mount ``image`` on ``mountpoint``, formatting it first with ``mkfs``; the
    pool's root directory is ``owner``'s (the node agent's), 0700."""
    if mkfs:
        await run("mkfs.btrfs", "-q", str(image))
    await run("mount", "-o", "loop", str(image), str(mountpoint))
    await adopt_pool(mountpoint, owner)


async def adopt_pool(root: Path, owner: tuple[int, int]) -> None:
    """Make the pool at ``root`` ``owner``'s (see requests.AdoptPool); a no-op once its
    root directory is theirs. The root is 0700."""
    if os.stat(root).st_uid != owner[0]:
        for subvolume in await asyncio.to_thread(_read_only_subvolumes, root):
            await run("btrfs", "property", "set", "-ts", str(subvolume), "ro", "false")
            try:
                await asyncio.to_thread(adopt_tree, subvolume, owner, JAIL_UIDS)
            finally:
                await run("btrfs", "property", "set", "-ts", str(subvolume), "ro", "true")
        await asyncio.to_thread(adopt_tree, root, owner, JAIL_UIDS)
    os.chmod(root, 0o700)


def _read_only_subvolumes(root: Path) -> list[Path]:
    found = []
    for kind in ("templates", "snapshots", "layers"):
        for path in (root / kind).glob("*/*" if kind == "templates" else "*"):
            if _is_subvolume(path) and not os.access(path, os.W_OK):
                found.append(path)
    return found


async def unmount_pool(image: Path, mountpoint: Path) -> None:
    """Unmount ``mountpoint`` if mounted and detach ``image``'s loop devices."""
    out = await run("losetup", "-l", "-n", "-O", "NAME", "-j", str(image), check=False)
    loops = [line.strip() for line in out.splitlines() if line.strip()]
    if await asyncio.to_thread(os.path.ismount, mountpoint):
        await run("umount", str(mountpoint))
    for loop in loops:
        await run("losetup", "-d", loop, check=False)


async def enable_quotas(root: Path) -> None:
    """Turn quota groups on and wait for their first scan; idempotent."""
    await run("btrfs", "quota", "enable", str(root))
    await run("btrfs", "quota", "rescan", "-W", str(root), timeout_s=600.0)


async def limit_subvolume(path: Path, max_referenced: int) -> None:
    """Limit the quota group of subvolume ``path`` to reference ``max_referenced`` bytes
    (the ioctl: a ``btrfs`` command costs a process per volume)."""

    def limit() -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            args = _QGROUP_LIMIT_ARGS.pack(0, _LIMIT_MAX_RFER, max_referenced, 0, 0, 0)
            fcntl.ioctl(fd, _QGROUP_LIMIT, bytearray(args))
        finally:
            os.close(fd)

    try:
        await asyncio.to_thread(limit)
    except OSError as exc:
        raise Unavailable(f"quota limit of {path} failed: {exc}") from exc


async def referenced_bytes(path: Path) -> int:
    """Bytes subvolume ``path`` refers to, as its quota group counts them."""
    out = await run("btrfs", "qgroup", "show", "-rf", "--raw", str(path))
    return _second_column(out, "btrfs qgroup show")


async def exclusive_bytes(path: Path) -> int:
    """Bytes of data only ``path`` refers to, by extent sharing (``btrfs filesystem du``)."""
    out = await run("btrfs", "filesystem", "du", "-s", "--raw", str(path), timeout_s=120.0)
    return _second_column(out, "btrfs filesystem du")


async def delete_subvolume(path: Path) -> None:
    """Delete the subvolume ``path`` (read-only or not); a plain directory is removed
    as a tree; idempotent."""
    if _is_subvolume(path):
        await run("btrfs", "property", "set", "-ts", str(path), "ro", "false", check=False)
        await run("btrfs", "subvolume", "delete", str(path))
    else:
        await asyncio.to_thread(shutil.rmtree, path, True)


def _second_column(out: str, what: str) -> int:
    try:
        return int(out.strip().splitlines()[-1].split()[1])
    except (IndexError, ValueError) as exc:
        raise Unavailable(f"cannot parse {what} output: {out[-200:]!r}") from exc


def _is_subvolume(path: Path) -> bool:
    # The root directory of every btrfs subvolume has inode number 256.
    try:
        return path.lstat().st_ino == 256
    except FileNotFoundError:
        return False
