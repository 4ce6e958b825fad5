"""RemoteNode: a NodeService on another host, reached through its HTTP API.

The client of space.node.http.server. Every method raises space.node.api.errors leaves only:
the node's error JSON becomes the leaf of its ``code``, a transport failure becomes
Unavailable, a transport timeout Timeout, and an answer that does not parse Unavailable
(the node is trusted with our token, but a broken one must not crash the caller).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from space.node.api import (
    BUILD_ID_HEADER,
    FILE_STAT_HEADER,
    MAX_METRICS_SAMPLES,
    NODE_API_PREFIX,
    EgressEvent,
    EgressLog,
    ExecRequest,
    ExportTicket,
    FileStat,
    ImportResult,
    NodeInfo,
    NodeService,
    ProcessInfo,
    ProcessSelector,
    PtySize,
    SandboxMetrics,
    SandboxSpec,
    SandboxStatus,
    SecretGrant,
    SnapshotInfo,
    TemplateImport,
    TemplateInfo,
    TemplateTicket,
    Unavailable,
    decode_templates,
    encode,
    encode_exec_request,
    encode_grants,
)
from space.node.http._answers import (
    MAX_ERROR_BYTES,
    RemoteBuildStream,
    RemoteExecStream,
    RemoteFileReader,
    RemoteWatchStream,
    error_from_response,
    exec_event,
    member,
    ndjson_lines,
    node_info,
    parse,
    snapshot,
    status,
    transport_error,
)
from space.node.http.port_tunnels import RemotePortTunnel, open_remote_tunnel
from space.node.templates import parse_ref

__all__ = ["RemoteNode", "error_from_response"]


def ca_context(ca_file: Path | None) -> ssl.SSLContext | bool:
    """What httpx verifies an https peer with: a context trusting ``ca_file`` alone, or
    the system's CAs (True) without one."""
    return True if ca_file is None else ssl.create_default_context(cafile=str(ca_file))


class RemoteNode(NodeService):
    """A node agent at ``base_url`` (e.g. ``http://10.0.0.2:7071``), authenticated by token.

    ``timeout_s`` bounds ordinary calls; ``create_timeout_s`` sandbox creation (a cold
    boot under TCG takes seconds); ``lifecycle_timeout_s`` resume, hibernate, snapshot,
    restore and fork, which save or load guest memory (seconds each under TCG). Streams
    (exec, attach, file transfers, template builds) have no read deadline: a process or
    a build step may stay silent for hours, a busy guest may start a process late, and
    the node itself fails a wait on a guest that stops responding (Timeout); their
    callers hold any other deadline. A timeout
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
        move_timeout_s: float = 900.0,
        transport: httpx.AsyncBaseTransport | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._verify = verify
        self._create_timeout = httpx.Timeout(create_timeout_s, connect=10.0)
        self._lifecycle_timeout = httpx.Timeout(lifecycle_timeout_s, connect=10.0)
        self._stream_timeout = httpx.Timeout(None, connect=10.0, write=60.0, pool=10.0)
        #: A move's import reads the whole stream before it answers.
        self._move_timeout = httpx.Timeout(move_timeout_s, connect=10.0)
        self._client = httpx.AsyncClient(
            base_url=self.base_url + NODE_API_PREFIX,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            transport=transport,
            verify=verify,
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
            raise transport_error(exc, sandbox_id) from exc
        if response.status_code < 400:
            return response
        try:
            body = b""
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_ERROR_BYTES:
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
            raise transport_error(exc, sandbox_id) from exc
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
        return node_info(await self._json("GET", "/info"))

    async def create_sandbox(self, spec: SandboxSpec) -> SandboxStatus:
        sid = spec.sandbox_id
        body = await self._json(
            "POST", "/sandboxes", sid, json=encode(spec), timeout=self._create_timeout
        )
        return status(body, sid)

    async def delete_sandbox(self, sandbox_id: str) -> None:
        await self._json("DELETE", f"/sandboxes/{sandbox_id}", sandbox_id)

    async def pause_sandbox(self, sandbox_id: str) -> SandboxStatus:
        body = await self._json("POST", f"/sandboxes/{sandbox_id}/pause", sandbox_id)
        return status(body, sandbox_id)

    async def resume_sandbox(self, sandbox_id: str) -> SandboxStatus:
        """Resumes a PAUSED or HIBERNATED sandbox; loading saved memory takes seconds."""
        url = f"/sandboxes/{sandbox_id}/resume"
        body = await self._json("POST", url, sandbox_id, timeout=self._lifecycle_timeout)
        return status(body, sandbox_id)

    async def hibernate_sandbox(self, sandbox_id: str) -> SandboxStatus:
        url = f"/sandboxes/{sandbox_id}/hibernate"
        body = await self._json("POST", url, sandbox_id, timeout=self._lifecycle_timeout)
        return status(body, sandbox_id)

    async def snapshot_sandbox(self, sandbox_id: str, snapshot_id: str) -> SnapshotInfo:
        body = await self._json(
            "POST",
            f"/sandboxes/{sandbox_id}/snapshots",
            sandbox_id,
            json={"snapshot_id": snapshot_id},
            timeout=self._lifecycle_timeout,
        )
        info = snapshot(body, snapshot_id, sandbox_id)
        if info.sandbox_id != sandbox_id:
            raise Unavailable(
                f"node took snapshot {snapshot_id} of {info.sandbox_id!r}", sandbox_id=sandbox_id
            )
        return info

    async def list_snapshots(self) -> list[SnapshotInfo]:
        body = await self._json("GET", "/snapshots")
        return parse(list[SnapshotInfo], member(body, "snapshots"))

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return snapshot(await self._json("GET", f"/snapshots/{snapshot_id}"), snapshot_id)

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
        return status(body, sandbox_id)

    async def fork_sandbox(self, sandbox_id: str, child_ids: list[str]) -> list[SandboxStatus]:
        """One status per child, in ``child_ids`` order (any other answer is Unavailable)."""
        body = await self._json(
            "POST",
            f"/sandboxes/{sandbox_id}/fork",
            sandbox_id,
            json={"child_ids": child_ids},
            timeout=self._lifecycle_timeout,
        )
        children = parse(list[SandboxStatus], member(body, "sandboxes", sandbox_id), sandbox_id)
        if [child.sandbox_id for child in children] != child_ids:
            raise Unavailable(
                f"node forked {[c.sandbox_id for c in children]}, not {child_ids}",
                sandbox_id=sandbox_id,
            )
        return children

    async def get_sandbox(self, sandbox_id: str) -> SandboxStatus:
        body = await self._json("GET", f"/sandboxes/{sandbox_id}", sandbox_id)
        return status(body, sandbox_id)

    async def list_sandboxes(self) -> list[SandboxStatus]:
        return parse(list[SandboxStatus], await self._json("GET", "/sandboxes"))

    async def _stream(self, sandbox_id: str, method: str, url: str, **kw: Any) -> RemoteExecStream:
        response = await self._send(method, url, sandbox_id, timeout=self._stream_timeout, **kw)
        lines = ndjson_lines(response, sandbox_id)
        try:
            first = await anext(lines, b"")
            start = json.loads(first) if first else {}
            if start.get("type") == "error":
                exec_event(first, sandbox_id)
            if start.get("type") != "start":
                raise Unavailable("exec stream did not start", sandbox_id=sandbox_id)
            return RemoteExecStream(response, lines, start, sandbox_id)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            await response.aclose()
            raise Unavailable(f"malformed exec start: {exc}", sandbox_id=sandbox_id) from exc
        except BaseException:
            await response.aclose()
            raise

    async def exec(self, sandbox_id: str, request: ExecRequest) -> RemoteExecStream:
        body = encode_exec_request(request)
        return await self._stream(sandbox_id, "POST", f"/sandboxes/{sandbox_id}/exec", json=body)

    async def attach(self, sandbox_id: str, process: str | ProcessSelector) -> RemoteExecStream:
        if isinstance(process, str):
            url = f"/sandboxes/{sandbox_id}/processes/{process}/attach"
            return await self._stream(sandbox_id, "GET", url)
        params: dict[str, str | int] = {} if process.pid is None else {"pid": process.pid}
        params |= {} if process.tag is None else {"tag": process.tag}
        url = f"/sandboxes/{sandbox_id}/processes/attach"
        return await self._stream(sandbox_id, "GET", url, params=params)

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        body = await self._json("GET", f"/sandboxes/{sandbox_id}/processes", sandbox_id)
        return parse(list[ProcessInfo], body, sandbox_id)

    async def kill_process(self, sandbox_id: str, process_id: str, signal: int = 9) -> None:
        url = f"/sandboxes/{sandbox_id}/processes/{process_id}/kill"
        await self._json("POST", url, sandbox_id, json={"signal": signal})

    async def write_stdin(
        self, sandbox_id: str, process_id: str, data: bytes, *, eof: bool = False
    ) -> int:
        url = f"/sandboxes/{sandbox_id}/processes/{process_id}/stdin"
        params = {"eof": "true" if eof else "false"}
        # The guest waits up to 30 s for the process to read, and longer for a busy guest.
        timeout = self._lifecycle_timeout
        body = await self._json(
            "POST", url, sandbox_id, content=data, params=params, timeout=timeout
        )
        written = body.get("bytes") if isinstance(body, dict) else None
        if isinstance(written, bool) or not isinstance(written, int) or written < 0:
            raise Unavailable("node answered no byte count", sandbox_id=sandbox_id)
        return written

    async def resize_pty(self, sandbox_id: str, process_id: str, size: PtySize) -> None:
        url = f"/sandboxes/{sandbox_id}/processes/{process_id}/resize"
        await self._json("POST", url, sandbox_id, json=encode(size))

    async def watch_dir(
        self, sandbox_id: str, path: str, *, recursive: bool = False, user: str = "user"
    ) -> RemoteWatchStream:
        url = f"/sandboxes/{sandbox_id}/files/watch"
        params = {"path": path, "recursive": "true" if recursive else "false", "user": user}
        response = await self._send(
            "GET", url, sandbox_id, params=params, timeout=self._stream_timeout
        )
        lines = ndjson_lines(response, sandbox_id)
        try:
            first = await anext(lines, b"")
            start = json.loads(first) if first else {}
            if start.get("type") != "start" or not isinstance(start.get("path"), str):
                raise Unavailable("watch stream did not start", sandbox_id=sandbox_id)
            return RemoteWatchStream(response, lines, start["path"], sandbox_id)
        except (ValueError, AttributeError) as exc:
            await response.aclose()
            raise Unavailable(f"malformed watch start: {exc}", sandbox_id=sandbox_id) from exc
        except BaseException:
            await response.aclose()
            raise

    async def open_port(self, sandbox_id: str, port: int) -> RemotePortTunnel:
        """A tunnel over the node's WebSocket route (space.node.http.port_tunnels)."""
        return await open_remote_tunnel(self.base_url, self._token, self._verify, sandbox_id, port)

    async def read_file(self, sandbox_id: str, path: str, user: str = "user") -> RemoteFileReader:
        url = f"/sandboxes/{sandbox_id}/files"
        params = {"path": path, "user": user}
        response = await self._send(
            "GET", url, sandbox_id, params=params, timeout=self._stream_timeout
        )
        try:
            stat = parse(FileStat, json.loads(response.headers[FILE_STAT_HEADER]), sandbox_id)
        except (KeyError, ValueError) as exc:
            await response.aclose()
            raise Unavailable("node sent no file stat", sandbox_id=sandbox_id) from exc
        return RemoteFileReader(response, stat, sandbox_id)

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
        return parse(FileStat, body, sandbox_id)

    async def list_dir(self, sandbox_id: str, path: str, user: str = "user") -> list[FileStat]:
        params = {"path": path, "user": user}
        body = await self._json(
            "GET", f"/sandboxes/{sandbox_id}/files/list", sandbox_id, params=params
        )
        return parse(list[FileStat], body, sandbox_id)

    async def stat(self, sandbox_id: str, path: str, user: str = "user") -> FileStat:
        params = {"path": path, "user": user}
        body = await self._json(
            "GET", f"/sandboxes/{sandbox_id}/files/stat", sandbox_id, params=params
        )
        return parse(FileStat, body, sandbox_id)

    async def sandbox_metrics(self, sandbox_id: str) -> list[SandboxMetrics]:
        body = await self._json("GET", f"/sandboxes/{sandbox_id}/metrics", sandbox_id)
        samples = parse(list[SandboxMetrics], member(body, "samples", sandbox_id), sandbox_id)
        if len(samples) > MAX_METRICS_SAMPLES:
            raise Unavailable(
                f"node answered {len(samples)} samples, more than {MAX_METRICS_SAMPLES}",
                sandbox_id=sandbox_id,
            )
        return samples

    async def make_dir(self, sandbox_id: str, path: str, user: str = "user") -> FileStat:
        url = f"/sandboxes/{sandbox_id}/files/mkdir"
        body = await self._json("POST", url, sandbox_id, json={"path": path, "user": user})
        return parse(FileStat, body, sandbox_id)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        await self._json("DELETE", f"/sandboxes/{sandbox_id}/files", sandbox_id, params=params)

    async def rename(self, sandbox_id: str, src: str, dst: str, user: str = "user") -> FileStat:
        url = f"/sandboxes/{sandbox_id}/files/rename"
        body = await self._json(
            "POST", url, sandbox_id, json={"src": src, "dst": dst, "user": user}
        )
        return parse(FileStat, body, sandbox_id)

    async def set_egress(self, sandbox_id: str, policy: dict[str, object] | None) -> None:
        """Replace the sandbox's egress policy; the node validates it (InvalidArgument)."""
        url = f"/sandboxes/{sandbox_id}/egress"
        await self._json("PUT", url, sandbox_id, json={"policy": policy})

    async def set_secrets(self, sandbox_id: str, grants: list[SecretGrant]) -> None:
        """Replace the secrets the sandbox's gateway may inject; the node checks them
        (InvalidArgument naming the grant, never its value). The body holds the values:
        it goes to the node only, and nothing here logs it."""
        url = f"/sandboxes/{sandbox_id}/secrets"
        await self._json("PUT", url, sandbox_id, json=encode_grants(grants))

    async def egress_log(self, sandbox_id: str, *, limit: int = 100) -> EgressLog:
        """The latest ``limit`` egress decisions, oldest first (1 to MAX_EGRESS_LOG_EVENTS,
        else InvalidArgument from the node); more than ``limit`` back is Unavailable. A
        node that answers no ``dropped`` (older than issue 17) has dropped nothing."""
        url = f"/sandboxes/{sandbox_id}/egress/log"
        body = await self._json("GET", url, sandbox_id, params={"limit": limit})
        events = parse(list[EgressEvent], member(body, "events", sandbox_id), sandbox_id)
        if len(events) > limit:
            raise Unavailable(
                f"node answered {len(events)} egress events, asked for {limit}",
                sandbox_id=sandbox_id,
            )
        dropped = body.get("dropped", 0) if isinstance(body, dict) else 0
        if not isinstance(dropped, int) or isinstance(dropped, bool) or dropped < 0:
            raise Unavailable(f"node answered a bad drop count {dropped!r}", sandbox_id=sandbox_id)
        return EgressLog(events, dropped)

    # moves (issue 19)

    async def export_sandbox(self, sandbox_id: str) -> ExportTicket:
        body = await self._json("POST", f"/sandboxes/{quote(sandbox_id)}/export", sandbox_id)
        return parse(ExportTicket, body, sandbox_id)

    async def stream_export(
        self, sandbox_id: str, ticket: str, parent: str | None
    ) -> AsyncIterator[bytes]:
        """The framed stream of an export (space.node.agent._moves), read with the
        ticket as the credential (not this client's token)."""
        url = f"/exports/{quote(sandbox_id)}/stream"
        async for chunk in self._ticket_stream(url, ticket, parent, sandbox_id):
            yield chunk

    async def _ticket_stream(
        self, url: str, ticket: str, parent: str | None, sandbox_id: str | None
    ) -> AsyncIterator[bytes]:
        """A move's or a shipment's stream (incremental against ``parent``), the ticket
        its credential."""
        params = {} if parent is None else {"parent": parent}
        response = await self._send(
            "GET",
            url,
            sandbox_id,
            params=params,
            headers={"Authorization": f"Bearer {ticket}"},
            timeout=self._stream_timeout,
        )
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise transport_error(exc, sandbox_id) from exc
        finally:
            await response.aclose()

    async def import_sandbox(self, ticket: ExportTicket, source_url: str) -> ImportResult:
        body = await self._json(
            "POST",
            "/imports",
            ticket.sandbox_id,
            json={"ticket": encode(ticket), "source_url": source_url},
            timeout=self._move_timeout,
        )
        return parse(ImportResult, body, ticket.sandbox_id)

    async def finish_export(self, sandbox_id: str, ticket: str, *, moved: bool) -> None:
        await self._json(
            "POST",
            f"/sandboxes/{quote(sandbox_id)}/export/finish",
            sandbox_id,
            json={"ticket": ticket, "moved": moved},
            timeout=self._lifecycle_timeout,
        )

    # archives (issue 19): uploads and downloads take as long as a move's stream

    async def archive_snapshot(self, snapshot_id: str) -> None:
        url = f"/snapshots/{quote(snapshot_id)}/archive"
        await self._json("POST", url, timeout=self._move_timeout)

    async def fetch_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        url = f"/snapshots/{quote(snapshot_id)}/fetch"
        return parse(SnapshotInfo, await self._json("POST", url, timeout=self._move_timeout))

    async def archive_sandbox(self, sandbox_id: str) -> SandboxStatus:
        url = f"/sandboxes/{quote(sandbox_id)}/archive"
        body = await self._json("POST", url, sandbox_id, timeout=self._move_timeout)
        return parse(SandboxStatus, body, sandbox_id)

    async def import_archive(self, sandbox_id: str, archive: str) -> ImportResult:
        url = f"/sandboxes/{quote(sandbox_id)}/import-archive"
        body = await self._json(
            "POST", url, sandbox_id, json={"archive": archive}, timeout=self._move_timeout
        )
        return parse(ImportResult, body, sandbox_id)

    async def delete_archive(self, name: str) -> None:
        await self._json("POST", "/archives/delete", json={"name": name})

    # template shipping (issue 19)

    async def export_template(self, ref: str) -> TemplateTicket:
        """Raises TemplateRefError (InvalidArgument) for a malformed ``ref``, sending
        nothing."""
        parse_ref(ref)
        body = await self._json("POST", f"/templates/{quote(ref, safe=':@')}/export")
        return parse(TemplateTicket, body)

    async def stream_template(
        self, digest: str, ticket: str, parent: str | None
    ) -> AsyncIterator[bytes]:
        """The framed stream of a template's build (space.node.agent._shipping), read
        with the ticket as the credential (not this client's token)."""
        url = f"/template-exports/{quote(digest, safe='')}/stream"
        async for chunk in self._ticket_stream(url, ticket, parent, None):
            yield chunk

    async def import_template(self, ticket: TemplateTicket, source_url: str) -> TemplateImport:
        """Reads the whole stream and makes the ready state before it answers: the
        move timeout bounds it."""
        body = await self._json(
            "POST",
            "/templates/imports",
            json={"ticket": encode(ticket), "source_url": source_url},
            timeout=self._move_timeout,
        )
        return parse(TemplateImport, body)

    async def build_template(self, context: AsyncIterable[bytes]) -> RemoteBuildStream:
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
        return RemoteBuildStream(response, build_id)

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
