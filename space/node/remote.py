"""RemoteNode: a NodeService on another host, reached through its HTTP API.

The client of space.node.http_api. Every method raises space.node.errors leaves only:
the node's error JSON becomes the leaf of its ``code``, a transport failure becomes
Unavailable, a transport timeout Timeout, and an answer that does not parse Unavailable
(the node is trusted with our token, but a broken one must not crash the caller).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from space.node.errors import (
    Conflict,
    InvalidArgument,
    NodeError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Timeout,
    Unavailable,
)
from space.node.http_api import PREFIX
from space.node.interface import (
    BuildEvent,
    BuildLog,
    ExecEvent,
    ExecExited,
    ExecOutput,
    ExecRequest,
    FileStat,
    NodeInfo,
    NodeService,
    PoolInfo,
    ProcessInfo,
    SandboxSpec,
    SandboxStatus,
    SnapshotInfo,
    TemplateInfo,
)
from space.node.templates import parse_ref
from space.node.wire import (
    BUILD_ID_HEADER,
    FILE_STAT_HEADER,
    decode,
    decode_build_event,
    decode_templates,
    encode,
    encode_exec_request,
)

__all__ = ["RemoteNode", "error_from_response"]

T = TypeVar("T")

#: The one table of the node API's error codes → node errors (others: NodeError).
_ERROR_BY_CODE: dict[str, type[NodeError]] = {
    cls.code: cls
    for cls in (
        NotFound,
        Conflict,
        InvalidArgument,
        PermissionDenied,
        ResourceExhausted,
        Timeout,
        Unavailable,
    )
}
#: An NDJSON line longer than this ends the stream (a chunk is at most ~1 MiB base64'd).
MAX_LINE_BYTES = 8 * 1024 * 1024
_MAX_ERROR_BYTES = 64 * 1024
#: PoolInfo's counters: JSON integers, never negative.
_POOL_COUNTS = tuple(f.name for f in dataclasses.fields(PoolInfo) if f.name != "template")


def error_from_response(status: int, body: bytes, sandbox_id: str | None) -> NodeError:
    """The node error for an error answer in the JSON error shape (or Unavailable)."""
    try:
        error = json.loads(body)["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        return Unavailable(f"node answered HTTP {status}", sandbox_id=sandbox_id)
    if code == "unauthenticated":
        return Unavailable(f"node rejected our token: {message}", sandbox_id=sandbox_id)
    return _ERROR_BY_CODE.get(code, NodeError)(message, sandbox_id=sandbox_id)


def _transport_error(exc: httpx.HTTPError, sandbox_id: str | None) -> NodeError:
    if isinstance(exc, httpx.TimeoutException):
        return Timeout(f"node did not answer in time: {exc!r}", sandbox_id=sandbox_id)
    return Unavailable(f"node unreachable: {exc!r}", sandbox_id=sandbox_id)


def _parse(cls: type[T], data: object, sandbox_id: str | None = None) -> T:
    try:
        return decode(cls, data)
    except ValidationError as exc:
        raise Unavailable(f"malformed answer from node: {exc}", sandbox_id=sandbox_id) from exc


def _member(body: object, name: str, sandbox_id: str | None = None) -> object:
    """``body[name]`` of an answer that must be a JSON object holding ``name``."""
    if not isinstance(body, dict) or name not in body:
        raise Unavailable(f"malformed answer from node: no {name!r}", sandbox_id=sandbox_id)
    return body[name]


def _node_info(body: object) -> NodeInfo:
    """The NodeInfo in ``body``; a pool whose counts are not JSON integers >= 0 is malformed.

    Decoding alone would take ``true``, ``"3"`` or ``3.0`` for a count.
    """
    info = _parse(NodeInfo, body)
    pools = body.get("pools", []) if isinstance(body, dict) else []
    for pool in pools if isinstance(pools, list) else []:
        bad = [name for name in _POOL_COUNTS if not _is_count(pool.get(name))]
        if bad or not pool.get("template"):
            fields = ", ".join(bad) or "template"
            raise Unavailable(f"malformed pool from node: {fields} in {pool!r:.200}")
    return info


def _is_count(value: object) -> bool:
    # bool is an int subclass: true is no count.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _status(body: object, sandbox_id: str) -> SandboxStatus:
    """The SandboxStatus of ``sandbox_id`` in ``body`` (another sandbox's is malformed)."""
    status = _parse(SandboxStatus, body, sandbox_id)
    if status.sandbox_id != sandbox_id:
        raise Unavailable(
            f"node answered for sandbox {status.sandbox_id!r}, not {sandbox_id!r}",
            sandbox_id=sandbox_id,
        )
    return status


def _snapshot(body: object, snapshot_id: str, sandbox_id: str | None = None) -> SnapshotInfo:
    """The SnapshotInfo of ``snapshot_id`` in ``body`` (another snapshot's is malformed)."""
    info = _parse(SnapshotInfo, body, sandbox_id)
    if info.snapshot_id != snapshot_id:
        raise Unavailable(
            f"node answered for snapshot {info.snapshot_id!r}, not {snapshot_id!r}",
            sandbox_id=sandbox_id,
        )
    return info


async def _lines(response: httpx.Response, sandbox_id: str | None) -> AsyncIterator[bytes]:
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
        raise _transport_error(exc, sandbox_id) from exc
    if buffer.strip():
        yield bytes(buffer)


def _event(line: bytes, sandbox_id: str) -> ExecEvent:
    try:
        obj = json.loads(line)
        kind = obj["type"]
        if kind in ("stdout", "stderr"):
            return ExecOutput(kind, base64.b64decode(obj["data"], validate=True))
        if kind == "exit":
            return _parse(
                ExecExited,
                {k: obj.get(k) for k in ("exit_code", "signal")}
                | {"timed_out": bool(obj.get("timed_out", False))},
            )
        if kind == "error":
            raise _ERROR_BY_CODE.get(str(obj["code"]), NodeError)(
                str(obj["message"]), sandbox_id=sandbox_id
            )
    except (ValueError, KeyError, TypeError) as exc:
        raise Unavailable(f"malformed exec event from node: {exc}", sandbox_id=sandbox_id) from exc
    raise Unavailable(f"unknown exec event type {kind!r} from node", sandbox_id=sandbox_id)


class _RemoteExecStream:
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

    async def __aiter__(self) -> AsyncIterator[ExecEvent]:
        async for line in self._lines:
            event = _event(line, self._sandbox_id)
            yield event
            if isinstance(event, ExecExited):
                return

    async def aclose(self) -> None:
        await self._response.aclose()


class _RemoteFileReader:
    def __init__(self, response: httpx.Response, stat: FileStat, sandbox_id: str) -> None:
        self._response = response
        self._sandbox_id = sandbox_id
        self.stat = stat

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            raise _transport_error(exc, self._sandbox_id) from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class _RemoteBuildStream:
    """BuildStream over the NDJSON answer of ``POST /templates/builds``."""

    def __init__(self, response: httpx.Response, build_id: str) -> None:
        self._response = response
        self.build_id = build_id

    async def __aiter__(self) -> AsyncIterator[BuildEvent]:
        async for line in _lines(self._response, None):
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


class RemoteNode(NodeService):
    """A node agent at ``base_url`` (e.g. ``http://10.0.0.2:7071``), authenticated by token.

    ``timeout_s`` bounds ordinary calls; ``create_timeout_s`` sandbox creation (a cold
    boot under TCG takes seconds); ``lifecycle_timeout_s`` resume, hibernate, snapshot,
    restore and fork, which save or load guest memory (seconds each under TCG). Streams
    (exec, attach, file transfers, template builds) have no read deadline: a process or
    a build step may stay silent for hours; their callers hold the deadline. A timeout
    raises Timeout but does not cancel the operation on the node, which may still
    complete: read the state back (or retry what is idempotent: create per sandbox id,
    snapshot per snapshot id).
    ``transport`` is for tests (httpx.ASGITransport over create_node_app).
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        create_timeout_s: float = 600.0,
        lifecycle_timeout_s: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._create_timeout = httpx.Timeout(create_timeout_s, connect=10.0)
        self._lifecycle_timeout = httpx.Timeout(lifecycle_timeout_s, connect=10.0)
        self._stream_timeout = httpx.Timeout(None, connect=10.0, write=60.0, pool=10.0)
        self._client = httpx.AsyncClient(
            base_url=self.base_url + PREFIX,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            transport=transport,
        )

    async def aclose(self) -> None:
        """Close the connection pool (idempotent)."""
        await self._client.aclose()

    async def _send(
        self, method: str, url: str, sandbox_id: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        """Send and return a streaming response with a 2xx status; the caller closes it."""
        try:
            request = self._client.build_request(method, url, **kwargs)
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _transport_error(exc, sandbox_id) from exc
        if response.status_code < 400:
            return response
        try:
            body = b""
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > _MAX_ERROR_BYTES:
                    break
        except httpx.HTTPError:
            pass
        finally:
            await response.aclose()
        raise error_from_response(response.status_code, body, sandbox_id)

    async def _json(
        self, method: str, url: str, sandbox_id: str | None = None, **kwargs: Any
    ) -> Any:
        response = await self._send(method, url, sandbox_id, **kwargs)
        try:
            body = await response.aread()
        except httpx.HTTPError as exc:
            raise _transport_error(exc, sandbox_id) from exc
        finally:
            await response.aclose()
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError as exc:
            raise Unavailable("node answered non-JSON", sandbox_id=sandbox_id) from exc

    async def info(self) -> NodeInfo:
        """The node's identity, load and warm pools (Unavailable if the answer is malformed)."""
        return _node_info(await self._json("GET", "/info"))

    async def create_sandbox(self, spec: SandboxSpec) -> SandboxStatus:
        sid = spec.sandbox_id
        body = await self._json(
            "POST", "/sandboxes", sid, json=encode(spec), timeout=self._create_timeout
        )
        return _status(body, sid)

    async def delete_sandbox(self, sandbox_id: str) -> None:
        await self._json("DELETE", f"/sandboxes/{sandbox_id}", sandbox_id)

    async def pause_sandbox(self, sandbox_id: str) -> SandboxStatus:
        body = await self._json("POST", f"/sandboxes/{sandbox_id}/pause", sandbox_id)
        return _status(body, sandbox_id)

    async def resume_sandbox(self, sandbox_id: str) -> SandboxStatus:
        """Resumes a PAUSED or HIBERNATED sandbox; loading saved memory takes seconds."""
        url = f"/sandboxes/{sandbox_id}/resume"
        body = await self._json("POST", url, sandbox_id, timeout=self._lifecycle_timeout)
        return _status(body, sandbox_id)

    async def hibernate_sandbox(self, sandbox_id: str) -> SandboxStatus:
        url = f"/sandboxes/{sandbox_id}/hibernate"
        body = await self._json("POST", url, sandbox_id, timeout=self._lifecycle_timeout)
        return _status(body, sandbox_id)

    async def snapshot_sandbox(self, sandbox_id: str, snapshot_id: str) -> SnapshotInfo:
        body = await self._json(
            "POST",
            f"/sandboxes/{sandbox_id}/snapshots",
            sandbox_id,
            json={"snapshot_id": snapshot_id},
            timeout=self._lifecycle_timeout,
        )
        info = _snapshot(body, snapshot_id, sandbox_id)
        if info.sandbox_id != sandbox_id:
            raise Unavailable(
                f"node took snapshot {snapshot_id} of {info.sandbox_id!r}", sandbox_id=sandbox_id
            )
        return info

    async def list_snapshots(self) -> list[SnapshotInfo]:
        body = await self._json("GET", "/snapshots")
        return _parse(list[SnapshotInfo], _member(body, "snapshots"))

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return _snapshot(await self._json("GET", f"/snapshots/{snapshot_id}"), snapshot_id)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._json("DELETE", f"/snapshots/{snapshot_id}")

    async def restore_sandbox(self, sandbox_id: str, snapshot_id: str) -> SandboxStatus:
        body = await self._json(
            "POST",
            f"/sandboxes/{sandbox_id}/restore",
            sandbox_id,
            json={"snapshot_id": snapshot_id},
            timeout=self._lifecycle_timeout,
        )
        return _status(body, sandbox_id)

    async def fork_sandbox(self, sandbox_id: str, child_ids: list[str]) -> list[SandboxStatus]:
        """One status per child, in ``child_ids`` order (any other answer is Unavailable)."""
        body = await self._json(
            "POST",
            f"/sandboxes/{sandbox_id}/fork",
            sandbox_id,
            json={"child_ids": child_ids},
            timeout=self._lifecycle_timeout,
        )
        children = _parse(list[SandboxStatus], _member(body, "sandboxes", sandbox_id), sandbox_id)
        if [child.sandbox_id for child in children] != child_ids:
            raise Unavailable(
                f"node forked {[c.sandbox_id for c in children]}, not {child_ids}",
                sandbox_id=sandbox_id,
            )
        return children

    async def get_sandbox(self, sandbox_id: str) -> SandboxStatus:
        body = await self._json("GET", f"/sandboxes/{sandbox_id}", sandbox_id)
        return _status(body, sandbox_id)

    async def list_sandboxes(self) -> list[SandboxStatus]:
        return _parse(list[SandboxStatus], await self._json("GET", "/sandboxes"))

    async def _stream(self, sandbox_id: str, method: str, url: str, **kw: Any) -> _RemoteExecStream:
        response = await self._send(method, url, sandbox_id, timeout=self._stream_timeout, **kw)
        lines = _lines(response, sandbox_id)
        try:
            first = await anext(lines, b"")
            start = json.loads(first) if first else {}
            if start.get("type") == "error":
                _event(first, sandbox_id)
            if start.get("type") != "start":
                raise Unavailable("exec stream did not start", sandbox_id=sandbox_id)
            return _RemoteExecStream(response, lines, start, sandbox_id)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            await response.aclose()
            raise Unavailable(f"malformed exec start: {exc}", sandbox_id=sandbox_id) from exc
        except BaseException:
            await response.aclose()
            raise

    async def exec(self, sandbox_id: str, request: ExecRequest) -> _RemoteExecStream:
        body = encode_exec_request(request)
        return await self._stream(sandbox_id, "POST", f"/sandboxes/{sandbox_id}/exec", json=body)

    async def attach(self, sandbox_id: str, process_id: str) -> _RemoteExecStream:
        url = f"/sandboxes/{sandbox_id}/processes/{process_id}/attach"
        return await self._stream(sandbox_id, "GET", url)

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        body = await self._json("GET", f"/sandboxes/{sandbox_id}/processes", sandbox_id)
        return _parse(list[ProcessInfo], body, sandbox_id)

    async def kill_process(self, sandbox_id: str, process_id: str, signal: int = 9) -> None:
        url = f"/sandboxes/{sandbox_id}/processes/{process_id}/kill"
        await self._json("POST", url, sandbox_id, json={"signal": signal})

    async def read_file(self, sandbox_id: str, path: str, user: str = "user") -> _RemoteFileReader:
        url = f"/sandboxes/{sandbox_id}/files"
        params = {"path": path, "user": user}
        response = await self._send(
            "GET", url, sandbox_id, params=params, timeout=self._stream_timeout
        )
        try:
            stat = _parse(FileStat, json.loads(response.headers[FILE_STAT_HEADER]), sandbox_id)
        except (KeyError, ValueError) as exc:
            await response.aclose()
            raise Unavailable("node sent no file stat", sandbox_id=sandbox_id) from exc
        return _RemoteFileReader(response, stat, sandbox_id)

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: AsyncIterable[bytes],
        *,
        user: str = "user",
        mode: int = 0o644,
    ) -> FileStat:
        params = {"path": path, "user": user, "mode": str(mode)}
        body = await self._json(
            "PUT",
            f"/sandboxes/{sandbox_id}/files",
            sandbox_id,
            params=params,
            content=data,
            timeout=self._stream_timeout,
        )
        return _parse(FileStat, body, sandbox_id)

    async def list_dir(self, sandbox_id: str, path: str, user: str = "user") -> list[FileStat]:
        params = {"path": path, "user": user}
        body = await self._json(
            "GET", f"/sandboxes/{sandbox_id}/files/list", sandbox_id, params=params
        )
        return _parse(list[FileStat], body, sandbox_id)

    async def stat(self, sandbox_id: str, path: str, user: str = "user") -> FileStat:
        params = {"path": path, "user": user}
        body = await self._json(
            "GET", f"/sandboxes/{sandbox_id}/files/stat", sandbox_id, params=params
        )
        return _parse(FileStat, body, sandbox_id)

    async def make_dir(self, sandbox_id: str, path: str, user: str = "user") -> FileStat:
        url = f"/sandboxes/{sandbox_id}/files/mkdir"
        body = await self._json("POST", url, sandbox_id, json={"path": path, "user": user})
        return _parse(FileStat, body, sandbox_id)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        await self._json("DELETE", f"/sandboxes/{sandbox_id}/files", sandbox_id, params=params)

    async def rename(self, sandbox_id: str, src: str, dst: str, user: str = "user") -> FileStat:
        url = f"/sandboxes/{sandbox_id}/files/rename"
        body = await self._json(
            "POST", url, sandbox_id, json={"src": src, "dst": dst, "user": user}
        )
        return _parse(FileStat, body, sandbox_id)

    async def build_template(self, context: AsyncIterable[bytes]) -> _RemoteBuildStream:
        """Upload ``context`` (streamed, never held whole) and follow the build's events.

        A bad archive or spec raises InvalidArgument (the node's message) before any
        event. The events are bounded: a line longer than MAX_LINE_BYTES, a log line longer
        than wire.MAX_BUILD_LOG_BYTES, a malformed or unknown event, or a stream ending
        without a result raise Unavailable while iterating.
        """
        response = await self._send(
            "POST",
            "/templates/builds",
            content=context,
            headers={"Content-Type": "application/x-tar"},
            timeout=self._stream_timeout,
        )
        build_id = response.headers.get(BUILD_ID_HEADER, "")
        if not build_id:
            await response.aclose()
            raise Unavailable(f"node sent no {BUILD_ID_HEADER} header with the build")
        return _RemoteBuildStream(response, build_id)

    async def list_templates(self) -> list[TemplateInfo]:
        body = await self._json("GET", "/templates")
        try:
            return decode_templates(body)
        except ValueError as exc:
            raise Unavailable(f"malformed templates from node: {exc}") from exc

    async def delete_template(self, ref: str) -> None:
        """Raises TemplateRefError (InvalidArgument) for a malformed ``ref``, sending nothing.

        Checked here so that no text, ``..`` or ``/`` included, can reach another route.
        """
        parse_ref(ref)
        await self._json("DELETE", f"/templates/{quote(ref, safe=':@')}")
