"""How RemoteNode reads the node's answers: errors, JSON bodies and NDJSON streams.

Private to space.node.http.client. The node is trusted with our token, but a broken one must
not crash the caller: anything that does not parse is Unavailable, and every line read
is bounded.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import httpx
from pydantic import ValidationError

from space.node.api import (
    EGRESS_DECISIONS,
    ERROR_BY_CODE,
    BuildEvent,
    BuildLog,
    ExecEvent,
    ExecExited,
    ExecOutput,
    FileStat,
    NodeError,
    NodeInfo,
    PoolInfo,
    SandboxStatus,
    SnapshotInfo,
    Timeout,
    Unavailable,
    WatchEvent,
    decode,
    decode_build_event,
    decode_watch_event,
)

__all__ = [
    "MAX_ERROR_BYTES",
    "MAX_LINE_BYTES",
    "RemoteBuildStream",
    "RemoteExecStream",
    "RemoteFileReader",
    "RemoteWatchStream",
    "error_from_response",
    "exec_event",
    "member",
    "ndjson_lines",
    "node_info",
    "parse",
    "snapshot",
    "status",
    "transport_error",
]

T = TypeVar("T")

#: An NDJSON line longer than this ends the stream (a chunk is at most ~1 MiB base64'd).
MAX_LINE_BYTES = 8 * 1024 * 1024
MAX_ERROR_BYTES = 64 * 1024
#: PoolInfo's counters: JSON integers, never negative.
_POOL_COUNTS = tuple(f.name for f in dataclasses.fields(PoolInfo) if f.name != "template")


def error_from_response(status: int, body: bytes, sandbox_id: str | None) -> NodeError:
    """The node error for an error answer in the JSON error shape (or Unavailable)."""
    try:
        error = json.loads(body)["error"]
        code, message = str(error["code"]), str(error["message"])
        details = error.get("details") or {}
    except (ValueError, KeyError, TypeError, AttributeError):
        return Unavailable(f"node answered HTTP {status}", sandbox_id=sandbox_id)
    if code == "unauthenticated":
        return Unavailable(f"node rejected our token: {message}", sandbox_id=sandbox_id)
    if not isinstance(details, dict):
        details = {}
    return ERROR_BY_CODE.get(code, NodeError).from_answer(message, details, sandbox_id=sandbox_id)


def transport_error(exc: httpx.HTTPError, sandbox_id: str | None) -> NodeError:
    if isinstance(exc, httpx.TimeoutException):
        return Timeout(f"node did not answer in time: {exc!r}", sandbox_id=sandbox_id)
    return Unavailable(f"node unreachable: {exc!r}", sandbox_id=sandbox_id)


def parse(cls: type[T], data: object, sandbox_id: str | None = None) -> T:
    try:
        return decode(cls, data)
    except ValidationError as exc:
        raise Unavailable(f"malformed answer from node: {exc}", sandbox_id=sandbox_id) from exc


def member(body: object, name: str, sandbox_id: str | None = None) -> object:
    """``body[name]`` of an answer that must be a JSON object holding ``name``."""
    if not isinstance(body, dict) or name not in body:
        raise Unavailable(f"malformed answer from node: no {name!r}", sandbox_id=sandbox_id)
    return body[name]


def node_info(body: object) -> NodeInfo:
    """The NodeInfo in ``body``; a pool or egress decision count that is not a JSON
    integer >= 0 (or a decision not in EGRESS_DECISIONS) is malformed.

    Decoding alone would take ``true``, ``"3"`` or ``3.0`` for a count.
    """
    info = parse(NodeInfo, body)
    pools = body.get("pools", []) if isinstance(body, dict) else []
    for pool in pools if isinstance(pools, list) else []:
        bad = [name for name in _POOL_COUNTS if not _is_count(pool.get(name))]
        if bad or not pool.get("template"):
            fields = ", ".join(bad) or "template"
            raise Unavailable(f"malformed pool from node: {fields} in {pool!r:.200}")
    decisions = body.get("egress_decisions", {}) if isinstance(body, dict) else {}
    if not isinstance(decisions, dict) or not all(
        name in EGRESS_DECISIONS and _is_count(count) for name, count in decisions.items()
    ):
        raise Unavailable(f"malformed egress decisions from node: {decisions!r:.200}")
    return info


def _is_count(value: object) -> bool:
    # bool is an int subclass: true is no count.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def status(body: object, sandbox_id: str) -> SandboxStatus:
    """The SandboxStatus of ``sandbox_id`` in ``body`` (another sandbox's is malformed)."""
    status = parse(SandboxStatus, body, sandbox_id)
    if status.sandbox_id != sandbox_id:
        raise Unavailable(
            f"node answered for sandbox {status.sandbox_id!r}, not {sandbox_id!r}",
            sandbox_id=sandbox_id,
        )
    return status


def snapshot(body: object, snapshot_id: str, sandbox_id: str | None = None) -> SnapshotInfo:
    """The SnapshotInfo of ``snapshot_id`` in ``body`` (another snapshot's is malformed)."""
    info = parse(SnapshotInfo, body, sandbox_id)
    if info.snapshot_id != snapshot_id:
        raise Unavailable(
            f"node answered for snapshot {info.snapshot_id!r}, not {snapshot_id!r}",
            sandbox_id=sandbox_id,
        )
    return info


async def ndjson_lines(response: httpx.Response, sandbox_id: str | None) -> AsyncIterator[bytes]:
    """The response's non-empty lines, each at most MAX_LINE_BYTES."""
    buffer = bytearray()
    try:
        async for chunk in response.aiter_bytes():
            buffer += chunk
            while (end := buffer.find(b"\n")) >= 0:
                line = bytes(buffer[:end])
                del buffer[: end + 1]
                if line.strip():
                    yield line
            if len(buffer) > MAX_LINE_BYTES:
                raise Unavailable("node sent an over-long NDJSON line", sandbox_id=sandbox_id)
    except httpx.HTTPError as exc:
        raise transport_error(exc, sandbox_id) from exc
    if buffer.strip():
        yield bytes(buffer)


def exec_event(line: bytes, sandbox_id: str) -> ExecEvent:
    try:
        obj = json.loads(line)
        kind = obj["type"]
        if kind in ("stdout", "stderr"):
            return ExecOutput(kind, base64.b64decode(obj["data"], validate=True))
        if kind == "exit":
            return parse(
                ExecExited,
                {k: obj.get(k) for k in ("exit_code", "signal")}
                | {"timed_out": bool(obj.get("timed_out", False))},
            )
        if kind == "error":
            raise ERROR_BY_CODE.get(str(obj["code"]), NodeError)(
                str(obj["message"]), sandbox_id=sandbox_id
            )
    except (ValueError, KeyError, TypeError) as exc:
        raise Unavailable(f"malformed exec event from node: {exc}", sandbox_id=sandbox_id) from exc
    raise Unavailable(f"unknown exec event type {kind!r} from node", sandbox_id=sandbox_id)


class RemoteExecStream:
    """ExecStream over an NDJSON response whose ``start`` line was already read."""

    def __init__(
        self,
        response: httpx.Response,
        lines: AsyncIterator[bytes],
        start: dict[str, Any],
        sandbox_id: str,
    ) -> None:
        self._response = response
        self._sandbox_id = sandbox_id
        self._lines = lines
        self.pid = int(start["pid"])
        self.process_id = str(start["process_id"])
        self.pty = start.get("pty") is True

    async def __aiter__(self) -> AsyncIterator[ExecEvent]:
        async for line in self._lines:
            event = exec_event(line, self._sandbox_id)
            yield event
            if isinstance(event, ExecExited):
                return

    async def aclose(self) -> None:
        await self._response.aclose()


class RemoteWatchStream:
    """WatchStream over the NDJSON answer of ``GET .../files/watch`` (start line read)."""

    def __init__(
        self, response: httpx.Response, lines: AsyncIterator[bytes], path: str, sandbox_id: str
    ) -> None:
        self._response = response
        self._lines = lines
        self._sandbox_id = sandbox_id
        self.path = path

    async def __aiter__(self) -> AsyncIterator[WatchEvent]:
        async for line in self._lines:
            try:
                obj = json.loads(line)
                if obj.get("type") == "error":
                    raise ERROR_BY_CODE.get(str(obj["code"]), NodeError)(
                        str(obj["message"]), sandbox_id=self._sandbox_id
                    )
                event = decode_watch_event(obj)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise Unavailable(
                    f"malformed watch event from node: {exc}", sandbox_id=self._sandbox_id
                ) from exc
            yield event

    async def aclose(self) -> None:
        await self._response.aclose()


class RemoteFileReader:
    def __init__(self, response: httpx.Response, stat: FileStat, sandbox_id: str) -> None:
        self._response = response
        self._sandbox_id = sandbox_id
        self.stat = stat

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            raise transport_error(exc, self._sandbox_id) from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class RemoteBuildStream:
    """BuildStream over the NDJSON answer of ``POST /templates/builds``."""

    def __init__(self, response: httpx.Response, build_id: str) -> None:
        self._response = response
        self.build_id = build_id

    async def __aiter__(self) -> AsyncIterator[BuildEvent]:
        async for line in ndjson_lines(self._response, None):
            try:
                event = decode_build_event(line)
            except ValueError as exc:
                raise Unavailable(f"malformed event of build {self.build_id}: {exc}") from exc
            yield event
            if not isinstance(event, BuildLog):
                return
        raise Unavailable(f"the stream of build {self.build_id} ended without its result")

    async def aclose(self) -> None:
        await self._response.aclose()
