"""Paths the node agent names, held by descriptor while root acts on them (issue 18).

The agent owns the directories it names to the broker, so a name checked and then
used can lead elsewhere by the time root acts on it: a directory swapped for a link to
/etc between the check and a chown. A path is therefore walked one component at a
time from ``/`` and never through a link (a link anywhere in it is refused), and held
open (``O_PATH``) while the request runs. Root acts through that descriptor:
``Pinned.path``, ``/proc/<broker>/fd/N``, leads to exactly the file that was checked,
for the broker and for the commands and the launcher it runs; a name not made yet is
looked up in a held parent, and opened without following a link.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from space.node.api import InvalidArgument

__all__ = ["Pinned", "pin", "pin_parent", "reopen"]

_WALK = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Pinned:
    """``text`` (absolute, no link in it) held by ``fd``; with ``name``, ``fd`` holds
    its parent directory and ``name`` is its last component, not opened."""

    text: str
    fd: int
    name: str | None = None

    @property
    def path(self) -> Path:
        """A path leading to the pinned file (or the name in the pinned parent), in
        this process and in any root process it starts."""
        held = Path(f"/proc/{os.getpid()}/fd/{self.fd}")
        return held / self.name if self.name is not None else held

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def pin(text: str, *, create: bool = False) -> Pinned:
    """``text`` held by an ``O_PATH`` descriptor, walked from ``/`` without following a
    link; with ``create``, missing directories are made (0700, root's until handed
    over). Raises InvalidArgument for a link, OSError if a component is missing."""
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in Path(text).parts[1:]:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
            step = os.open(part, _WALK, dir_fd=fd)
            os.close(fd)
            fd = step
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise InvalidArgument(f"{text} is not a plain path: {part} is a link")
    except BaseException:
        os.close(fd)
        raise
    return Pinned(text, fd)


def pin_parent(text: str) -> Pinned:
    """``text``'s parent directory held (as ``pin``), its last component a name in it."""
    parent, name = os.path.split(text)
    pinned = pin(parent)
    return Pinned(text, pinned.fd, name)


def reopen(pinned: Pinned, flags: int) -> int:
    """A descriptor of the pinned file itself (not its parent) opened with ``flags``;
    the caller closes it."""
    if pinned.name is not None:
        return os.open(pinned.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pinned.fd)
    return os.open(f"/proc/self/fd/{pinned.fd}", flags | os.O_CLOEXEC)
