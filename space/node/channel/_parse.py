"""Validation of the guest's JSON messages (EVENT and RESULT payloads).

Everything the guest sends is hostile: each parser checks types and sizes field by
field and raises space.protocol.ProtocolError on anything unexpected, which closes
the channel.
"""

from __future__ import annotations

from typing import Literal, cast

from space.node.api import ExecExited, FileStat, ProcessInfo
from space.protocol import IDENTITY_FIELDS, ProtocolError

__all__ = [
    "MAX_TEXT_CHARS",
    "expect_event",
    "parse_applied",
    "parse_error",
    "parse_exited",
    "parse_process",
    "parse_started",
    "parse_started_event",
    "parse_stat",
    "require_bool",
    "require_int",
    "require_list",
    "require_number",
    "require_str",
]

#: Longest string field we accept from the guest (paths, names, messages).
MAX_TEXT_CHARS = 8192
_MAX_INT = 2**63 - 1
_STAT_TYPES = ("file", "dir", "symlink", "other")


def _fail(key: str, what: str) -> ProtocolError:
    return ProtocolError(f"field {key!r} of a guest message must be {what}")


def require_int(message: dict[str, object], key: str, *, optional: bool = False) -> int | None:
    value = message.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not -_MAX_INT <= value <= _MAX_INT:
        raise _fail(key, "an integer" + (" or null" if optional else ""))
    return value


def _required_int(message: dict[str, object], key: str, low: int = 0) -> int:
    value = require_int(message, key)
    assert value is not None
    if value < low:
        raise _fail(key, f"an integer >= {low}")
    return value


def require_number(message: dict[str, object], key: str) -> float:
    value = message.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(key, "a number")
    return float(value)


def require_str(
    message: dict[str, object], key: str, *, optional: bool = False, max_chars: int = MAX_TEXT_CHARS
) -> str | None:
    value = message.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > max_chars:
        raise _fail(key, f"a string of at most {max_chars} characters")
    return value


def _required_str(message: dict[str, object], key: str, max_chars: int = MAX_TEXT_CHARS) -> str:
    value = require_str(message, key, max_chars=max_chars)
    assert value is not None
    return value


def require_bool(message: dict[str, object], key: str) -> bool:
    value = message.get(key)
    if not isinstance(value, bool):
        raise _fail(key, "a boolean")
    return value


def require_list(message: dict[str, object], key: str, max_items: int) -> list[dict[str, object]]:
    value = message.get(key)
    if not isinstance(value, list) or len(value) > max_items:
        raise _fail(key, f"a list of at most {max_items} items")
    if not all(isinstance(item, dict) for item in value):
        raise _fail(key, "a list of objects")
    return cast(list[dict[str, object]], value)


def expect_event(message: dict[str, object], name: str) -> None:
    if message.get("event") != name:
        raise ProtocolError(f"unexpected guest event {str(message.get('event'))[:64]!r}")


def parse_started(message: dict[str, object]) -> tuple[int, str]:
    """(pid, process_id) of an EVENT started or a background exec's RESULT."""
    return _required_int(message, "pid", 1), _required_str(message, "process_id", 64)


def parse_started_event(message: dict[str, object]) -> tuple[int, str, bool]:
    """(pid, process_id, pty) of an EVENT started; ``pty`` absent (a spaced from before
    it was sent: a sandbox restored from an older snapshot) is False."""
    pid, process_id = parse_started(message)
    pty = False if message.get("pty") is None else require_bool(message, "pty")
    return pid, process_id, pty


def parse_exited(message: dict[str, object]) -> ExecExited:
    return ExecExited(
        exit_code=require_int(message, "exit_code", optional=True),
        signal=require_int(message, "signal", optional=True),
        timed_out=require_bool(message, "timed_out"),
    )


def parse_error(message: dict[str, object]) -> tuple[str, str]:
    """(code, message) of a RESULT with ``"ok": false``."""
    error = message.get("error")
    if not isinstance(error, dict):
        raise ProtocolError("a failed RESULT must carry an error object")
    code = _required_str(error, "code", 64)
    text = require_str(error, "message", optional=True, max_chars=64 * 1024) or ""
    return code, text[:1000]


def parse_stat(stat: object) -> FileStat:
    if not isinstance(stat, dict):
        raise ProtocolError("a Stat must be an object")
    kind = stat.get("type")
    if kind not in _STAT_TYPES:
        raise _fail("type", f"one of {_STAT_TYPES}")
    return FileStat(
        name=_required_str(stat, "name"),
        path=_required_str(stat, "path"),
        type=cast(Literal["file", "dir", "symlink", "other"], kind),
        size=_required_int(stat, "size"),
        mode=_required_int(stat, "mode"),
        mtime=require_number(stat, "mtime"),
        owner=_required_str(stat, "owner", 256),
    )


def parse_process(entry: dict[str, object]) -> ProcessInfo:
    argv = entry.get("argv")
    if argv is not None and not (
        isinstance(argv, list) and len(argv) <= 4096 and all(isinstance(a, str) for a in argv)
    ):
        raise _fail("argv", "a list of strings or null")
    pid, process_id = parse_started(entry)
    return ProcessInfo(
        process_id=process_id,
        pid=pid,
        argv=cast(list[str] | None, argv),
        cmd=require_str(entry, "cmd", optional=True, max_chars=64 * 1024),
        running=require_bool(entry, "running"),
        exit_code=require_int(entry, "exit_code", optional=True),
        signal=require_int(entry, "signal", optional=True),
        started_at=require_number(entry, "started_at"),
        tag=require_str(entry, "tag", optional=True, max_chars=64),
        pty=entry.get("pty") is True,
    )


def parse_applied(message: dict[str, object], requested: list[str]) -> list[str]:
    """The ``applied`` list of a system.identity RESULT: exactly the ``requested`` names.

    ``ok: true`` means everything was applied, so a list that misses a requested name,
    adds another, repeats one or holds anything but known names is a violation.
    """
    applied = message.get("applied")
    if not isinstance(applied, list) or len(applied) > len(IDENTITY_FIELDS):
        raise _fail("applied", f"a list of at most {len(IDENTITY_FIELDS)} names")
    if not all(isinstance(name, str) and name in IDENTITY_FIELDS for name in applied):
        raise _fail("applied", f"a list of names out of {IDENTITY_FIELDS}")
    if len(set(applied)) != len(applied) or set(applied) != set(requested):
        raise _fail("applied", f"the requested names {requested}, each once")
    return [str(name) for name in applied]
