"""Each sandbox's egress decisions, as an append-only JSON-lines file.

One file per sandbox, ``<root>/<sandbox_id>.jsonl``, one EgressEvent per line (keys are
its field names). A file that would grow past ``max_bytes`` is first rotated to
``<sandbox_id>.jsonl.1`` (replacing the previous one), so a sandbox holds at most about
twice ``max_bytes`` on disk however much its guest talks.

Writing never raises for the disk (a failure is logged): auditing must not break the
guest's traffic. Reading reads only the tail of the files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from pathlib import Path

from space.node.api import EgressEvent, InvalidArgument, Unavailable
from space.node.core.validation import check_id

__all__ = ["DEFAULT_MAX_BYTES", "MAX_READ_LIMIT", "AuditLog"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
#: Most events one read returns.
MAX_READ_LIMIT = 10_000
_BLOCK_BYTES = 64 * 1024
_OPEN_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
_FIELDS = frozenset(field.name for field in dataclasses.fields(EgressEvent))


class AuditLog:
    """The audit files of a node's sandboxes, under ``root`` (created on first write).

    Sandbox ids are checked with space.node.core.validation.check_id (InvalidArgument), so
    no id names a file outside ``root``. Safe to share between threads.
    """

    def __init__(self, root: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1:
            raise InvalidArgument(f"max_bytes must be positive, got {max_bytes!r}")
        self._root = root
        self._max_bytes = max_bytes
        self._lock = threading.Lock()

    def write(self, sandbox_id: str, event: EgressEvent) -> None:
        """Append ``event`` to the sandbox's log, rotating the file first if it is full.

        Raises InvalidArgument for a bad sandbox id only; a disk error (or an event
        that does not serialize) is logged as a warning and the event is lost.
        """
        path = self._path(sandbox_id)
        try:
            line = _encode(event)
            with self._lock:
                self._append(path, line)
        except (OSError, ValueError, TypeError) as exc:
            log.warning("egress audit of %s lost an event: %s", sandbox_id, exc)

    def read(self, sandbox_id: str, limit: int = 100) -> list[EgressEvent]:
        """The sandbox's most recent ``limit`` events, oldest first.

        Reads the rotated file too when the current one holds fewer than ``limit``.
        Malformed lines are skipped; missing files count as empty. Raises
        InvalidArgument for a bad id or a ``limit`` outside 0..MAX_READ_LIMIT, and
        Unavailable when a file exists but cannot be read.
        """
        path = self._path(sandbox_id)
        if not isinstance(limit, int) or not 0 <= limit <= MAX_READ_LIMIT:
            raise InvalidArgument(
                f"limit must be within 0..{MAX_READ_LIMIT}, got {limit!r}", sandbox_id=sandbox_id
            )
        try:
            # Under the lock: a rotation between the two reads would skip or repeat events.
            with self._lock:
                events = _tail(path, limit)
                if len(events) < limit:
                    events = _tail(_rotated(path), limit - len(events)) + events
        except OSError as exc:
            raise Unavailable(f"cannot read the egress log: {exc}", sandbox_id=sandbox_id) from exc
        return events

    def remove(self, sandbox_id: str) -> None:
        """Delete the sandbox's log files. Idempotent.

        Raises InvalidArgument for a bad id, Unavailable if a file cannot be deleted.
        """
        path = self._path(sandbox_id)
        try:
            with self._lock:
                path.unlink(missing_ok=True)
                _rotated(path).unlink(missing_ok=True)
        except OSError as exc:
            raise Unavailable(
                f"cannot remove the egress log: {exc}", sandbox_id=sandbox_id
            ) from exc

    def _path(self, sandbox_id: str) -> Path:
        return self._root / f"{check_id(sandbox_id)}.jsonl"

    def _append(self, path: Path, line: bytes) -> None:
        self._root.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size and size + len(line) > self._max_bytes:
            os.replace(path, _rotated(path))
        fd = os.open(path, _OPEN_APPEND, 0o600)
        try:
            # One write of an O_APPEND file: a line is never interleaved with another.
            os.write(fd, line)
        finally:
            os.close(fd)


def _rotated(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def _encode(event: EgressEvent) -> bytes:
    record = {
        "time": event.time,
        "protocol": event.protocol,
        "host": event.host,
        "address": event.address,
        "port": event.port,
        "decision": event.decision,
        "reason": event.reason,
        "bytes_out": event.bytes_out,
        "bytes_in": event.bytes_in,
        "secrets": list(event.secrets),
    }
    # ensure_ascii: a hostile host name cannot break the one-event-per-line format.
    return (json.dumps(record, ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")


def _tail(path: Path, limit: int) -> list[EgressEvent]:
    """The last ``limit`` well-formed events of ``path``, oldest first; [] if missing.

    Reads backwards block by block, so the cost follows ``limit``, not the file size.
    """
    newest_first: list[EgressEvent] = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return []
    try:
        position = os.fstat(fd).st_size
        partial = b""
        while position > 0 and len(newest_first) < limit:
            start = max(0, position - _BLOCK_BYTES)
            lines = (os.pread(fd, position - start, start) + partial).split(b"\n")
            position = start
            # Unless the file's start was reached, the first piece may be the end of a
            # line that begins in an earlier block.
            partial = lines.pop(0) if position > 0 else b""
            newest_first += _decode_newest_first(lines, limit - len(newest_first))
    finally:
        os.close(fd)
    return newest_first[::-1]


def _decode_newest_first(lines: list[bytes], limit: int) -> list[EgressEvent]:
    events: list[EgressEvent] = []
    for line in reversed(lines):
        event = _decode(line) if line else None
        if event is not None:
            events.append(event)
            if len(events) == limit:
                break
    return events


def _decode(line: bytes) -> EgressEvent | None:
    """The event of one line, or None if it is not a well-formed event."""
    try:
        record = json.loads(line)
        if not isinstance(record, dict) or not _well_typed(record):
            return None
        return EgressEvent(
            time=float(record["time"]),
            protocol=record["protocol"],
            host=record["host"],
            address=record["address"],
            port=record["port"],
            decision=record["decision"],
            reason=record["reason"],
            bytes_out=record["bytes_out"],
            bytes_in=record["bytes_in"],
            secrets=tuple(record["secrets"]),
        )
    except (ValueError, OverflowError, RecursionError):
        return None


def _well_typed(record: dict[str, object]) -> bool:
    if not _FIELDS.issubset(record.keys()):
        return False
    secrets = record["secrets"]
    return (
        _is_number(record["time"])
        and all(isinstance(record[key], str) for key in ("protocol", "decision", "reason"))
        and all(isinstance(record[key], str | None) for key in ("host", "address"))
        and (record["port"] is None or _is_int(record["port"]))
        and _is_int(record["bytes_out"])
        and _is_int(record["bytes_in"])
        and isinstance(secrets, list)
        and all(isinstance(name, str) for name in secrets)
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)
