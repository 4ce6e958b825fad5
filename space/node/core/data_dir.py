"""Who may read the data dir: its owner only (issue 18, "nothing leaks by mode").

The data dir holds every guest's disk and RAM (``pool.img``), saved memory, the
database (sandbox env values, API key hashes), ``master.key`` and ``node-token``. A
server process sets ``umask 077`` before it writes anything (``restrict_umask``), so
what it creates is 0600 (files) or 0700 (directories); ``secure_data_dir`` makes the
data dir 0700 and brings an existing one, written by an older version with 0755/0644,
to the same modes. It fixes the top level only: below a 0700 directory nobody but its
owner gets in, whatever the modes further down, and walking a pool of many GiB or the
image cache on every start would be slow.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["DIR_MODE", "FILE_MODE", "restrict_umask", "secure_data_dir", "secure_top_level"]

DIR_MODE = 0o700
FILE_MODE = 0o600


def restrict_umask() -> None:
    """Make everything this process creates from now on owner-only (umask 077).

    Process-wide and inherited by children; call it first thing in a server command.
    """
    os.umask(0o077)


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
    and a socket's mode is its server's to set. An entry that vanishes is skipped. An
    entry of another uid (the egress gateway's directory, shared with the node agent's
    group) only loses what others may do.
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
        info = os.fstat(fd)
        current = stat.S_IMODE(info.st_mode)
        if info.st_uid != os.geteuid():
            mode = current & ~0o007
        if current != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
