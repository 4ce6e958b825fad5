"""The guest's error root: an operation failure that becomes a RESULT error.

    OpError         root; ``code`` is a space.protocol.ErrorCode sent to the host
    SessionLost     the host session a stream belonged to has ended (internal signal)

``from_oserror`` is the one table from errno to wire code.
"""

from __future__ import annotations

import errno

from space.protocol import ErrorCode

__all__ = ["OpError", "SessionLost", "from_oserror"]


class OpError(Exception):
    """An operation failed; the stream ends with RESULT ok:false carrying ``code``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def to_result(self) -> dict[str, object]:
        return {"ok": False, "error": {"code": str(self.code), "message": self.message}}


class SessionLost(Exception):
    """The session a stream belongs to ended; nothing more may be sent on it."""


_ERRNO_CODES: dict[int, ErrorCode] = {
    errno.ENOENT: ErrorCode.NOT_FOUND,
    errno.EEXIST: ErrorCode.ALREADY_EXISTS,
    errno.EACCES: ErrorCode.PERMISSION_DENIED,
    errno.EPERM: ErrorCode.PERMISSION_DENIED,
    errno.EROFS: ErrorCode.PERMISSION_DENIED,
    errno.EISDIR: ErrorCode.IS_A_DIRECTORY,
    errno.ENOTDIR: ErrorCode.NOT_A_DIRECTORY,
    errno.ENOTEMPTY: ErrorCode.NOT_EMPTY,
    errno.ENOSPC: ErrorCode.RESOURCE_EXHAUSTED,
    errno.EDQUOT: ErrorCode.RESOURCE_EXHAUSTED,
    errno.EMFILE: ErrorCode.RESOURCE_EXHAUSTED,
    errno.ENAMETOOLONG: ErrorCode.INVALID_ARGUMENT,
    # O_NOFOLLOW on a symlink: we refuse to act through a link.
    errno.ELOOP: ErrorCode.INVALID_ARGUMENT,
    errno.EXDEV: ErrorCode.INVALID_ARGUMENT,
    errno.ENOEXEC: ErrorCode.INVALID_ARGUMENT,
}


def from_oserror(exc: OSError) -> OpError:
    code = _ERRNO_CODES.get(exc.errno or 0, ErrorCode.INTERNAL)
    where = f": {exc.filename}" if exc.filename is not None else ""
    return OpError(code, f"{exc.strerror or exc}{where}")
