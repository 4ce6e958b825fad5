"""Owner-only key files, written once: the control plane's master key file and the
node key (issue 18) are made and read the same way.

Stdlib only and importing nothing of SPACE, so both layers may use it. Made atomically
(a complete temporary file, linked into place: never a half-written key, and when two
processes race the first one's key wins). Read without following a link, refused if
it is not a regular file, if group or others have any permission on it, or if it is
larger than the caller allows.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

__all__ = ["KeyFileProblem", "create_key_file", "read_key_file"]


class KeyFileProblem(Exception):
    """A key file cannot be used; the message says why, naming the file."""


def create_key_file(path: Path, text: str) -> bool:
    """Make ``path`` (mode 0600) holding ``text`` unless it exists; True if made here."""
    if path.exists():
        return False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            return False  # made meanwhile by another process: theirs is the key
    finally:
        temporary.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return True


def read_key_file(path: Path, *, what: str, max_bytes: int) -> bytes:
    """The bytes of the key file ``path`` (``what`` names it in errors).

    Raises FileNotFoundError if it does not exist, KeyFileProblem for anything else.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise KeyFileProblem(f"cannot open {what} {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileProblem(f"{what} {path} is not a regular file")
        if info.st_mode & 0o077:
            raise KeyFileProblem(
                f"{what} {path} is open to group or others"
                f" (mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it"
            )
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise KeyFileProblem(f"{what} {path} is larger than {max_bytes} bytes")
    return data
