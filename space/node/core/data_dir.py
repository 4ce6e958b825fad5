"""Who may read the data dir: its owner only (issue 18, "nothing leaks by mode").

The data dir holds every guest's disk and RAM (``pool.img``), saved memory, the
database (sandbox env values, API key hashes), ``master.key`` and ``node-token``.
``secure_data_dir`` makes the data dir 0700 and brings its top level (an existing one,
written by an older version with 0755/0644, too) to 0600 files and 0700 directories.
It fixes the top level only: below a 0700 directory nobody but its owner gets in,
whatever the modes further down, and walking a pool of many GiB on every start would
be slow.

The server does not set ``umask 077`` yet: the VMM jail's helper
(space/node/vmm/_jail_exec.py) makes the directories of a jail's root with
``os.makedirs(mode=0o755)``, which the umask would turn into 0700 root-owned
directories its unprivileged QEMU cannot cross (measured: "Failed to unlink socket
.../agent.sock: Permission denied"). Once the helper sets its own umask, the CLI can.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["DIR_MODE", "FILE_MODE", "secure_data_dir", "secure_top_level"]

DIR_MODE = 0o700
FILE_MODE = 0o600


def secure_data_dir(data_dir: Path) -> None:
    """Create ``data_dir`` if absent; make it and its top-level entries owner-only.

    Idempotent. Raises OSError if the directory cannot be created or chmod'ed.
    """
    data_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    secure_top_level(data_dir)


def secure_top_level(directory: Path) -> None:
    """``directory`` 0700, its direct entries 0700 (directories) or 0600 (files).

    Symbolic links, sockets and devices are left alone: a link could point anywhere
    (entries are opened O_NOFOLLOW, so one swapped in meanwhile is not followed either),
    and a socket's mode is its server's to set. An entry that vanishes is skipped.
    """
    os.chmod(directory, DIR_MODE)  # the operator may have made it a link to elsewhere
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                _chmod(entry.path, DIR_MODE)
            elif entry.is_file(follow_symlinks=False):
                _chmod(entry.path, FILE_MODE)


def _chmod(path: str, mode: int) -> None:
    # Linux has no lchmod: open without following a link, then fchmod the descriptor.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
