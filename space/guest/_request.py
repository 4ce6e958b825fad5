"""Validation of request fields and resolution of users and paths.

The host may be any version: every field is checked for type and size here and a bad
one raises OpError(invalid_argument), never a crash.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass

from space.protocol import ErrorCode

from ._errors import OpError

__all__ = ["MAX_PATH_CHARS", "Account", "Accounts", "Fields"]

MAX_PATH_CHARS = 4096
MAX_STR_CHARS = 32 * 1024
MAX_LIST_ITEMS = 4096


def _bad(message: str) -> OpError:
    return OpError(ErrorCode.INVALID_ARGUMENT, message)


class Fields:
    """Typed, bounded access to one request's JSON fields."""

    def __init__(self, request: dict[str, object]) -> None:
        self._request = request

    def mapping(self) -> Mapping[str, object]:
        """The whole request, read-only, for operations that decode it as one message."""
        return self._request

    def string(
        self, key: str, default: str | None = None, *, max_chars: int = MAX_STR_CHARS
    ) -> str:
        value = self._request.get(key, default)
        if not isinstance(value, str):
            raise _bad(f"{key} must be a string")
        if len(value) > max_chars or "\0" in value:
            raise _bad(f"{key} is longer than {max_chars} characters or contains NUL")
        return value

    def optional_string(self, key: str, *, max_chars: int = MAX_STR_CHARS) -> str | None:
        if self._request.get(key) is None:
            return None
        return self.string(key, max_chars=max_chars)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._request.get(key, default)
        if not isinstance(value, bool):
            raise _bad(f"{key} must be a boolean")
        return value

    def integer(self, key: str, default: int, *, low: int, high: int) -> int:
        value = self._request.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise _bad(f"{key} must be an integer in [{low}, {high}]")
        return value

    def object(self, key: str) -> dict[str, object]:
        value = self._request.get(key)
        if not isinstance(value, dict) or len(value) > MAX_LIST_ITEMS:
            raise _bad(f"{key} must be an object")
        return value

    def optional_seconds(self, key: str) -> float | None:
        value = self._request.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad(f"{key} must be a number or null")
        if not 0 < value <= 366 * 86400:
            raise _bad(f"{key} must be positive and at most a year")
        return float(value)

    def string_list(self, key: str) -> list[str] | None:
        value = self._request.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not value or len(value) > MAX_LIST_ITEMS:
            raise _bad(f"{key} must be a non-empty list of at most {MAX_LIST_ITEMS} strings")
        if not all(isinstance(item, str) and "\0" not in item for item in value):
            raise _bad(f"{key} must hold strings without NUL")
        return [str(item) for item in value]

    def string_dict(self, key: str) -> dict[str, str]:
        value = self._request.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict) or len(value) > MAX_LIST_ITEMS:
            raise _bad(f"{key} must be an object of at most {MAX_LIST_ITEMS} strings")
        result: dict[str, str] = {}
        for name, item in value.items():
            if not isinstance(item, str) or not name or "=" in name or "\0" in name + item:
                raise _bad(f"{key} must map names (no '=', no NUL) to strings")
            result[name] = item
        return result


@dataclass(frozen=True, slots=True)
class Account:
    name: str
    uid: int
    gid: int
    home: str
    groups: tuple[int, ...]

    def resolve(self, path: str) -> str:
        """Absolute, normalised form of ``path`` (relative paths start at the home)."""
        if not path or len(path) > MAX_PATH_CHARS or "\0" in path:
            raise _bad("path must be 1 to 4096 characters without NUL")
        return os.path.normpath(os.path.join(self.home, path))

    def spawn_kwargs(self) -> dict[str, object]:
        """Arguments for subprocess that drop to this account (none if we already are it)."""
        if self.uid == os.geteuid():
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def chown(self, path_or_fd: str | int) -> None:
        """Give a file we created to this account (a no-op unless we are root)."""
        if os.geteuid() != 0 or self.uid == 0:
            return
        if isinstance(path_or_fd, int):
            os.fchown(path_or_fd, self.uid, self.gid)
        else:
            os.lchown(path_or_fd, self.uid, self.gid)


#: What accounts are read from: a change to either (a user added, a group joined) is
#: seen by the next request. Looking an account up cost each exec under gVisor 0.3-0.9
#: ms (getgrouplist reads all of /etc/group); two stats cost 0.008 ms.
_ACCOUNT_FILES = ("/etc/passwd", "/etc/group")
#: Names remembered at most (then all are forgotten): requests name few accounts.
_MAX_KNOWN = 64


def _files_signature() -> tuple[tuple[int, int, int, int] | None, ...]:
    signature: list[tuple[int, int, int, int] | None] = []
    for path in _ACCOUNT_FILES:
        try:
            info = os.stat(path)
        except OSError:
            signature.append(None)
        else:
            signature.append((info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
    return tuple(signature)


class Accounts:
    """Resolves request ``user`` names; ``user_default`` stands in for the name "user".
    What it resolved is remembered until the account files change."""

    def __init__(self, user_default: str | None = None, home_default: str | None = None) -> None:
        self._user_default = user_default
        self._home_default = home_default
        self._known: dict[str, Account] = {}
        self._signature = _files_signature()

    def get(self, fields: Fields) -> Account:
        name = fields.string("user", "user", max_chars=64)
        signature = _files_signature()
        if signature != self._signature or len(self._known) >= _MAX_KNOWN:
            self._known.clear()
            self._signature = signature
        account = self._known.get(name)
        if account is None:
            account = self._known[name] = self._look_up(name)
        return account

    def _look_up(self, name: str) -> Account:
        real = self._user_default if name == "user" and self._user_default else name
        try:
            entry = pwd.getpwnam(real)
        except KeyError:
            raise OpError(ErrorCode.INVALID_ARGUMENT, f"unknown user {name!r}") from None
        if os.geteuid() != 0 and entry.pw_uid != os.geteuid():
            raise OpError(ErrorCode.PERMISSION_DENIED, f"spaced cannot act as {name!r}")
        home = self._home_default if name == "user" and self._home_default else entry.pw_dir
        groups = tuple(g for g in os.getgrouplist(real, entry.pw_gid) if g != entry.pw_gid)
        return Account(real, entry.pw_uid, entry.pw_gid, home or "/", groups)


def owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
