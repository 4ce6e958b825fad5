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
    root: Path,
    owner: tuple[int, int],
    jail_uids: range,
    *,
    skip: Iterable[Path] = (),
    dir_fd: int | None = None,
) -> None:
    """Walk ``root`` (neither across mounts nor into ``skip``; links are left alone)
    and hand what root or a jail (``jail_uids``) owns to ``owner`` (uid, gid). With
    ``dir_fd``, the walk starts at the directory that descriptor holds, which ``root``
    names.

    By descriptor throughout: a directory handed over early in the walk is the
    agent's, and a link it puts in place of an entry must give it nothing."""
    mounts, skipped = mount_points(), {str(p) for p in skip}
    top = "." if dir_fd is not None else str(root)
    for directory, dirs, files, fd in os.fwalk(top, dir_fd=dir_fd):
        here = os.path.normpath(os.path.join(root, os.path.relpath(directory, top)))
        dirs[:] = [d for d in dirs if os.path.join(here, d) not in mounts | skipped]
        for name in (".", *dirs, *files) if directory == top else (*dirs, *files):
            _adopt(name, fd, owner, jail_uids)


def _adopt(name: str, dir_fd: int, owner: tuple[int, int], jail_uids: range) -> None:
    uid, gid = owner
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        held = f"/proc/self/fd/{fd}"  # leads to exactly the file opened, never a link's target
        if stat.S_ISLNK(info.st_mode):
            return
        if info.st_uid == 0:
            os.chown(held, uid, gid)
        elif info.st_uid in jail_uids and info.st_gid != gid:
            os.chown(held, info.st_uid, gid)
            group = 0o070 | stat.S_ISGID if stat.S_ISDIR(info.st_mode) else 0o060
            os.chmod(held, stat.S_IMODE(info.st_mode) | group)
    finally:
        os.close(fd)


def mount_points() -> set[str]:
    """Every mount point of this mount namespace. Not ``os.path.ismount``: each btrfs
    subvolume has a device number of its own, which that takes for a mount."""
    with open("/proc/self/mountinfo") as f:
        return {_unescape(line.split()[4]) for line in f}


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
