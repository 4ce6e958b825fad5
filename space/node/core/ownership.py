"""Handing a tree a node running as root made to the node agent's user (issue 18).

Root runs this (the root broker for the pool, a server before it drops root for the
data and run directories): what root owns becomes the agent's, what a VMM jail was
handed (a disk, a console log, a run directory and the sockets in it) joins the
agent's group, which may read and write it, as the jails' hand-over does now.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

__all__ = ["adopt_tree", "mount_points"]


def adopt_tree(
    root: Path, owner: tuple[int, int], jail_uids: range, *, skip: Iterable[Path] = ()
) -> None:
    """Walk ``root`` (neither across mounts nor into ``skip``; links are left alone)
    and hand what root or a jail (``jail_uids``) owns to ``owner`` (uid, gid)."""
    uid, gid = owner
    mounts, skipped = mount_points(), {str(p) for p in skip}
    for directory, dirs, files in os.walk(root):
        dirs[:] = [
            d for d in dirs if os.path.join(directory, d) not in mounts | skipped
        ]  # fmt: skip
        for path in (directory, *(os.path.join(directory, n) for n in dirs + files)):
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                continue
            if info.st_uid == 0:
                os.chown(path, uid, gid, follow_symlinks=False)
            elif info.st_uid in jail_uids and info.st_gid != gid:
                os.chown(path, info.st_uid, gid, follow_symlinks=False)
                group = 0o070 | stat.S_ISGID if stat.S_ISDIR(info.st_mode) else 0o060
                os.chmod(path, stat.S_IMODE(info.st_mode) | group)


def mount_points() -> set[str]:
    """Every mount point of this mount namespace. Not ``os.path.ismount``: each btrfs
    subvolume has a device number of its own, which that takes for a mount."""
    with open("/proc/self/mountinfo") as f:
        return {_unescape(line.split()[4]) for line in f}


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
