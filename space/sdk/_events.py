"""Reading the exec NDJSON stream: bounded lines, base64 data, incremental UTF-8.

The wire format (docs/api.md): one JSON object a line, of type ``start``, ``stdout``,
``stderr`` (``data`` is base64), ``exit`` or ``error``.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from space.sdk._models import CommandResult
from space.sdk.errors import InternalError, ResourceExhausted, SpaceError, Unavailable, error_class

__all__ = ["MAX_LINE_BYTES", "OutputCollector", "StartEvent", "iter_events", "read_events"]

#: Longest NDJSON line accepted: a base64 chunk of output plus its envelope. The server
#: sends chunks of at most a few hundred KiB; anything far larger is a broken peer.
MAX_LINE_BYTES = 8 << 20

#: Receives decoded output text; its return value is ignored.
OutputCallback = Callable[[str], object]


@dataclass(frozen=True, slots=True)
class StartEvent:
    pid: int
    process_id: str


async def iter_events(
    response: httpx.Response, *, max_line_bytes: int = MAX_LINE_BYTES
) -> AsyncIterator[dict[str, Any]]:
    """Yield each JSON object of an NDJSON body; raise on an over-long or bad line."""
    pending = bytearray()
    async for chunk in response.aiter_bytes():
        pending += chunk
        while (end := pending.find(b"\n")) >= 0:
            line = bytes(pending[:end])
            del pending[: end + 1]
            if line.strip():
                yield _parse_line(line)
        if len(pending) > max_line_bytes:
            raise ResourceExhausted(
                f"exec stream line longer than {max_line_bytes} bytes",
                details={"limit_bytes": max_line_bytes, "observed_bytes": len(pending)},
            )
    if pending.strip():
        yield _parse_line(bytes(pending))


def _parse_line(line: bytes) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError:
        raise InternalError("exec stream carried a line that is not JSON") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise InternalError("exec stream carried an event without a type")
    return event


class OutputCollector:
    """Decodes stdout/stderr chunks, feeds callbacks, keeps a bounded copy.

    One incremental UTF-8 decoder per stream, so a multibyte character split across two
    chunks reaches the callback whole. Callbacks see every byte; the kept copy stops at
    ``max_bytes`` per stream and sets ``truncated``.
    """

    def __init__(
        self,
        *,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        max_bytes: int,
    ) -> None:
        self._callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        self._decoders = {
            name: codecs.getincrementaldecoder("utf-8")(errors="replace")
            for name in ("stdout", "stderr")
        }
        self._kept = {"stdout": bytearray(), "stderr": bytearray()}
        self._max_bytes = max_bytes
        self.truncated = False

    def feed(self, stream: str, data: bytes) -> None:
        kept = self._kept[stream]
        room = self._max_bytes - len(kept)
        if len(data) > room:
            self.truncated = True
        kept += data[: max(room, 0)]
        text = self._decoders[stream].decode(data)
        callback = self._callbacks[stream]
        if text and callback is not None:
            callback(text)

    def finish(self) -> tuple[str, str]:
        """Flush the decoders (an incomplete trailing character becomes U+FFFD)."""
        for stream, decoder in self._decoders.items():
            rest = decoder.decode(b"", final=True)
            callback = self._callbacks[stream]
            if rest and callback is not None:
                callback(rest)
        return (
            self._kept["stdout"].decode("utf-8", "replace"),
            self._kept["stderr"].decode("utf-8", "replace"),
        )


async def read_events(
    events: AsyncIterator[dict[str, Any]],
    collector: OutputCollector,
    *,
    on_start: Callable[[StartEvent], None] | None = None,
    sandbox_id: str | None = None,
    operation: str = "commands.run",
) -> CommandResult:
    """Consume an exec stream to its ``exit`` event and build the CommandResult.

    Raises the mapped SpaceError for an ``error`` event, Unavailable if the stream ends
    without an exit, InternalError for a malformed event.
    """
    async for event in events:
        kind = event["type"]
        if kind in ("stdout", "stderr"):
            collector.feed(kind, _decode_data(event))
        elif kind == "start":
            start = parse_start(event)
            if on_start is not None:
                on_start(start)
        elif kind == "exit":
            stdout, stderr = collector.finish()
            return CommandResult(
                stdout=stdout,
                stderr=stderr,
                exit_code=_optional_int(event.get("exit_code")),
                signal=_optional_int(event.get("signal")),
                timed_out=bool(event.get("timed_out", False)),
                output_truncated=collector.truncated,
            )
        elif kind == "error":
            raise error_from_event(event, sandbox_id=sandbox_id, operation=operation)
        # Unknown event types are skipped: newer servers may add some.
    raise Unavailable(
        "the exec stream ended before the process exited",
        sandbox_id=sandbox_id,
        operation=operation,
    )


def parse_start(event: dict[str, Any]) -> StartEvent:
    try:
        return StartEvent(pid=int(event["pid"]), process_id=str(event["process_id"]))
    except (KeyError, TypeError, ValueError):
        raise InternalError("malformed start event in exec stream") from None


def error_from_event(
    event: dict[str, Any], *, sandbox_id: str | None, operation: str
) -> SpaceError:
    """The SpaceError leaf for an ``error`` event (same table as HTTP errors)."""
    code = event.get("code")
    cls = error_class(code=str(code) if code is not None else None, status_code=None)
    return cls(
        str(event.get("message") or "the process failed"),
        sandbox_id=sandbox_id,
        operation=operation,
    )


def _decode_data(event: dict[str, Any]) -> bytes:
    try:
        return base64.b64decode(event["data"], validate=True)
    except (KeyError, TypeError, binascii.Error):
        raise InternalError("exec stream carried output that is not base64") from None


def _optional_int(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InternalError(f"exec stream carried a non-integer status: {value!r}")
    return value
