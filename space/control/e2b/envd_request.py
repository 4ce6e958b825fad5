"""What every envd request carries besides its body: the user it acts as.

E2B's SDK names the user as ``Authorization: Basic base64("<user>:")`` (RPCs, uploads)
or ``?username=`` (file routes); none means envd's default user, ``user``.
"""

from __future__ import annotations

import base64
import binascii
import re

from starlette.datastructures import Headers

from space.control.e2b.connect import Code, ConnectError
from space.control.sandbox_traffic import gone_message
from space.control.store.repo import SandboxRecord

__all__ = ["DEFAULT_USER", "checked_user", "not_running_message", "user_of"]

DEFAULT_USER = "user"
_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


def checked_user(name: str) -> str:
    """``name`` if it is a user name; ConnectError(invalid_argument) otherwise."""
    if not _USER_RE.fullmatch(name):
        raise ConnectError(Code.INVALID_ARGUMENT, f"user {name[:40]!r} is not a user name")
    return name


def user_of(headers: Headers) -> str:
    """The user ``Authorization: Basic`` names, or DEFAULT_USER. Raises
    ConnectError(invalid_argument) for a malformed header or user name."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic" or not value.strip():
        return DEFAULT_USER
    try:
        decoded = base64.b64decode(value.strip()[:512], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError(Code.INVALID_ARGUMENT, "malformed Basic authorization") from None
    return checked_user(decoded.partition(":")[0] or DEFAULT_USER)


def not_running_message(record: SandboxRecord) -> str:
    """What envd's proxy says of a sandbox that is not running (and not deleted)."""
    return f"{gone_message(record.id)}: it is {record.state}"
