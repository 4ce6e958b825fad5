"""Each sandbox's egress decisions, as an append-only JSON-lines file.

One file per sandbox, ``<root>/<sandbox_id>.jsonl``, one EgressEvent per line (keys are
its field names). A file that would grow past ``max_bytes`` is first rotated to
``<sandbox_id>.jsonl.1`` (replacing the previous one), so a sandbox holds at most about
twice ``max_bytes`` on disk however much its guest talks.

Writes are bounded per sandbox too (issue 17: a guest's DNS queries at 600/s wrote
3.7 MB in 30 s): a token bucket admits ``rate_per_s`` events a second on average and
``burst`` at once; events past it are dropped and counted. When an event is admitted
again (at most once a second), an audit event ``decision="drop"`` saying how many were
dropped is written before it, and the sandbox's total drops since its log began go to
``<sandbox_id>.dropped`` (``dropped`` reads it). Drops after the last admitted event
are counted but written only with the next one.

Writing never raises for the disk (a failure is logged): auditing must not break the
guest's traffic. Reading reads only the tail of the files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from space.node.api import EGRESS_DECISIONS, EgressEvent, InvalidArgument, Unavailable
from space.node.core.token_bucket import Clock, TokenBucket
from space.node.core.validation import check_id

__all__ = [
    "DEFAULT_BURST",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_RATE_PER_S",
    "DROP_DECISION",
    "MAX_READ_LIMIT",
    "AuditLog",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
#: Events a second one sandbox may add to its audit on average, and at once. A busy
#: but ordinary guest (a package install: a DNS query and a connection per download)
#: makes tens a second in bursts of a few hundred; at 50/s of ~250-byte lines a
#: sandbox writes ~12 KB/s, and the node's 64 sandboxes together ~3,200 small writes a
#: second at worst, instead of one guest's flood setting the pace.
DEFAULT_RATE_PER_S = 50.0
DEFAULT_BURST = 200
#: The decision of the audit's own event that counts the events it dropped.
DROP_DECISION = "drop"

#: Seconds between two drop events of one sandbox: a sustained flood adds one a second.
_DROP_REPORT_INTERVAL_S = 1.0
#: Sandboxes whose budget is kept before idle (full, nothing pending) ones go.
_MAX_IDLE_BUDGETS = 1024
#: Most events one read returns.
MAX_READ_LIMIT = 10_000
_BLOCK_BYTES = 64 * 1024
#: The most an audit file or directory may be: the writer's umask takes the rest. The
#: gateway (umask 007) shares its logs with the node agent's group, which reads them
#: (issue 18: its directory is set-group-id, the agent's group); the agent's own 077.
_FILE_MODE, _DIR_MODE = 0o660, 0o770
_OPEN_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
_FIELDS = frozenset(field.name for field in dataclasses.fields(EgressEvent))


@dataclass(slots=True)
class _Budget:
    """One sandbox's write budget, and the drops not yet written."""

    bucket: TokenBucket
    pending: int = 0
    reported: float = float("-inf")


class AuditLog:
    """The audit files of a node's sandboxes, under ``root`` (created on first write).

    Sandbox ids are checked with space.node.core.validation.check_id (InvalidArgument), so
    no id names a file outside ``root``. Safe to share between threads. ``clock``
    (monotonic seconds) paces the write budget, so tests can move time.
    """

    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        rate_per_s: float = DEFAULT_RATE_PER_S,
        burst: int = DEFAULT_BURST,
        clock: Clock = time.monotonic,
    ) -> None:
        if max_bytes < 1:
            raise InvalidArgument(f"max_bytes must be positive, got {max_bytes!r}")
        if not rate_per_s > 0 or burst < 1:
            raise InvalidArgument(f"rate {rate_per_s!r}/s, burst {burst!r}: both must be > 0")
        self._root = root
        self._max_bytes = max_bytes
        self._rate_per_s = rate_per_s
        self._burst = burst
        self._clock = clock
        self._budgets: dict[str, _Budget] = {}
        self._dropped: dict[str, int] = {}
        # Decisions of every sandbox since this process began, written or dropped: the
        # node's Prometheus counters (issue 20), which must not undercount a flood.
        self._decisions = dict.fromkeys(EGRESS_DECISIONS, 0)
        self._lock = threading.Lock()

    def write(self, sandbox_id: str, event: EgressEvent) -> None:
        """Append ``event`` to the sandbox's log, rotating the file first if it is full;
        past the sandbox's write budget, count it as dropped instead (see the module).

        Raises InvalidArgument for a bad sandbox id only; a disk error (or an event
        that does not serialize) is logged as a warning and the event is lost.
        """
        path = self._path(sandbox_id)
        try:
            line = _encode(event)
            with self._lock:
                if event.decision in self._decisions:
                    self._decisions[event.decision] += 1
                report = self._admit(sandbox_id)
                if report is None:
                    return
                if report:
                    self._append(path, _encode(self._drop_event(report)))
                    self._record_dropped(sandbox_id, report)
                self._append(path, line)
        except (OSError, ValueError, TypeError) as exc:
            log.warning("egress audit of %s lost an event: %s", sandbox_id, exc)

    def decisions(self) -> dict[str, int]:
        """How many egress decisions of each kind (EGRESS_DECISIONS) this process has audited,
        of every sandbox, those dropped over a write budget included."""
        with self._lock:
            return dict(self._decisions)

    def dropped(self, sandbox_id: str) -> int:
        """How many of the sandbox's events were dropped over its write budget, as of
        the last drop event written (0 if none). Raises InvalidArgument for a bad id,
        Unavailable if the count exists but cannot be read."""
        path = self._dropped_path(sandbox_id)
        try:
            return _read_count(path)
        except OSError as exc:
            raise Unavailable(
                f"cannot read the egress drop count: {exc}", sandbox_id=sandbox_id
            ) from exc

    def _admit(self, sandbox_id: str) -> int | None:
        """None: drop the event (counted). Else admit it, after a drop event for the
        returned count if that is not 0."""
        budget = self._budgets.get(sandbox_id)
        if budget is None:
            self._forget_idle_budgets()
            budget = _Budget(TokenBucket(self._rate_per_s, self._burst, self._clock))
            self._budgets[sandbox_id] = budget
        if budget.bucket.tokens < 1:
            budget.pending += 1
            return None
        budget.bucket.charge(1)
        now = self._clock()
        if not budget.pending or now - budget.reported < _DROP_REPORT_INTERVAL_S:
            return 0
        report, budget.pending, budget.reported = budget.pending, 0, now
        return report

    def _forget_idle_budgets(self) -> None:
        """Bound the budgets kept: past _MAX_IDLE_BUDGETS, forget every sandbox whose
        bucket is full again and has no drops pending (forgetting it changes nothing:
        a new bucket starts full)."""
        if len(self._budgets) < _MAX_IDLE_BUDGETS:
            return
        for sandbox_id, budget in list(self._budgets.items()):
            if not budget.pending and budget.bucket.tokens >= self._burst:
                del self._budgets[sandbox_id]
                self._dropped.pop(sandbox_id, None)

    def _drop_event(self, count: int) -> EgressEvent:
        return EgressEvent(
            time=time.time(),
            protocol="audit",
            host=None,
            address=None,
            port=None,
            decision=DROP_DECISION,
            reason=f"{count} events dropped: over {self._rate_per_s:g}/s (burst {self._burst})",
        )

    def _record_dropped(self, sandbox_id: str, count: int) -> None:
        """Add ``count`` to the sandbox's total on disk (written whole, then renamed)."""
        path = self._dropped_path(sandbox_id)
        total = self._dropped.get(sandbox_id)
        if total is None:
            total = _read_count(path)
        self._dropped[sandbox_id] = total = total + count
        staging = path.with_name(path.name + ".new")
        staging.unlink(missing_ok=True)
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
        try:
            os.write(fd, f"{total}\n".encode())
        finally:
            os.close(fd)
        os.replace(staging, path)

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
                self._dropped_path(sandbox_id).unlink(missing_ok=True)
                self._budgets.pop(sandbox_id, None)
                self._dropped.pop(sandbox_id, None)
        except OSError as exc:
            raise Unavailable(
                f"cannot remove the egress log: {exc}", sandbox_id=sandbox_id
            ) from exc

    def _path(self, sandbox_id: str) -> Path:
        return self._root / f"{check_id(sandbox_id)}.jsonl"

    def _dropped_path(self, sandbox_id: str) -> Path:
        return self._root / f"{check_id(sandbox_id)}.dropped"

    def _append(self, path: Path, line: bytes) -> None:
        self._root.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size and size + len(line) > self._max_bytes:
            os.replace(path, _rotated(path))
        fd = os.open(path, _OPEN_APPEND, _FILE_MODE)
        try:
            # One write of an O_APPEND file: a line is never interleaved with another.
            os.write(fd, line)
        finally:
            os.close(fd)


def _rotated(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def _read_count(path: Path) -> int:
    """The count a drop total file holds; 0 if it is missing or not a count."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return 0
    try:
        text = os.read(fd, 32).strip()
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else 0


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
