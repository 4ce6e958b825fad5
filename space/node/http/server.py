"""The node agent's own HTTP API: NodeService under ``/node/v1``, for remote control planes.

``create_node_app(node, token)`` serves every NodeService method; space.node.http.client's
``RemoteNode`` is its client, so a control plane on another host holds that node like a
local one. Bodies are JSON (dataclasses of space.node.api.interface, bytes as base64),
exec/attach answer NDJSON (``start`` line, then events, as docs/api.md; ``GET
/sandboxes/{id}/processes/attach?pid=|tag=`` attaches to the running process with that
pid or tag in one guest request, issue 20), file contents
travel as raw bytes (a read's FileStat in the ``X-Space-File-Stat`` header). ``/info``
answers NodeInfo, the node's warm pools included. Snapshots live under ``/snapshots``
(node-wide: a snapshot outlives its sandbox); taking, restoring and forking are POSTs on
the sandbox (``/snapshots``, ``/restore``, ``/fork``). Templates live under ``/templates``:
``POST /templates/builds`` takes the build context (a tar, plain or gzip'd) as its raw
body and answers the build's NDJSON events (its id in ``X-Build-Id``); ``GET`` lists,
``DELETE /templates/{ref}`` deletes (``name``, ``name:tag``, ``name@digest``);
shipping a build to another node (issue 19) is ``POST /templates/{ref}/export`` on the
source, ``POST /templates/imports`` on the target, which reads the source's
``GET /template-exports/{digest}/stream`` with the ticket (as a move's stream). A
process started with ``open_stdin`` or ``pty`` takes input as the raw body of ``POST
/sandboxes/{id}/processes/{pid}/stdin`` (``?eof=true`` closes it; answers ``{"bytes":
n}``) and a new window size as ``POST .../resize`` ``{"rows", "cols"}`` (204); ``GET
/sandboxes/{id}/files/watch?path=&recursive=`` answers a directory's changes as NDJSON
(``watch_lines``). ``GET /sandboxes/{id}/ports/{port}/tunnel`` upgrades to a WebSocket
carrying a port tunnel (space.node.http.port_tunnels).
``GET /sandboxes/{id}/metrics`` answers ``{"samples": [SandboxMetrics, ...]}``. A
sandbox's egress policy is ``PUT /sandboxes/{id}/egress`` with ``{"policy": {...} |
null}`` (204); ``GET /sandboxes/{id}/egress/log?limit=N`` (1 to MAX_EGRESS_LOG_EVENTS,
default 100) answers ``{"events": [EgressEvent, ...], "dropped": N}``, oldest first
(``dropped``: events the audit dropped over its write budget). Its secret
grants are ``PUT /sandboxes/{id}/secrets`` with ``{"grants": [SecretGrant, ...]}``
(204); that body holds secret values, so no body is ever logged here. Errors
answer ``{"error": {"code", "message", "details"}}`` with the status of
``STATUS_BY_CODE`` (space.node.api.http_errors, shared with the control plane). Every
request needs ``Authorization: Bearer <node token>``.

The edge is the control plane's (issue 17; space.node.api.http_edges and
http_connections, shared): the token is checked from the headers before a byte of the
body is read (401), a JSON body over MAX_NODE_JSON_BODY_BYTES is 413 unread (file
uploads and build contexts stream with their own caps), and ``node_server`` bounds the
header read time and size and each client's open connections.

The JSON and NDJSON shapes live in space.node.api.wire, shared with RemoteNode and the
control plane.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response, WebSocket
from fastapi.responses import StreamingResponse
from starlette.datastructures import Headers
from starlette.types import Scope

from space.limits import MAX_JSON_BODY_BYTES
from space.node.api import (
    BUILD_ID_HEADER,
    FILE_STAT_HEADER,
    MAX_EGRESS_LOG_EVENTS,
    NDJSON,
    NODE_API_PREFIX,
    ExportTicket,
    InvalidArgument,
    NodeService,
    PermissionDenied,
    ProcessSelector,
    SandboxSpec,
    TemplateTicket,
    build_lines,
    decode,
    decode_child_ids,
    decode_egress_policy,
    decode_exec_request,
    decode_grants,
    decode_pty_size,
    decode_snapshot_id,
    encode,
    encode_templates,
    ndjson_lines,
    watch_lines,
)
from space.node.api.http_connections import (
    HEADER_TIMEOUT_S,
    MAX_CONNECTIONS_PER_CLIENT,
    guarded_protocol,
)
from space.node.api.http_edges import Authenticate, Edges, StreamedRoute, require_bearer
from space.node.api.http_errors import install_error_handlers
from space.node.http.port_tunnels import serve_tunnel

__all__ = ["MAX_NODE_JSON_BODY_BYTES", "STREAMED_ROUTES", "create_node_app", "node_server"]

T = TypeVar("T")


# -- edges ---------------------------------------------------------------------------

#: Most bytes of a JSON body to a node. The control plane builds these from tenant
#: bodies of at most MAX_JSON_BODY_BYTES and from what it holds: an exec's stdin grows
#: by 4/3 in base64; a sandbox's secret grants reach 64 values of 16 KiB, which JSON's
#: ``\uXXXX`` escapes can triple (3 MiB), plus 64 x 32 hosts (0.5 MiB). Four times
#: the tenant's cap holds each.
MAX_NODE_JSON_BODY_BYTES = 4 * MAX_JSON_BODY_BYTES

#: The routes whose bodies stream through: a file upload (bounded by the sandbox's
#: disk) and a build context (bounded by the node's build, space.node.templates).
STREAMED_ROUTES: tuple[StreamedRoute, ...] = (
    ("PUT", re.compile(re.escape(NODE_API_PREFIX) + r"/sandboxes/[^/]+/files")),
    ("POST", re.compile(re.escape(NODE_API_PREFIX) + r"/templates/builds")),
)


#: The routes a node token does not open: a move's and a template's stream, which take
#: their ticket instead (checked by the node before a byte is sent; issue 19).
_TICKET_STREAM = re.compile(
    re.escape(NODE_API_PREFIX) + r"/(exports|template-exports)/[^/]+/stream"
)


def _token_check(token: str) -> Authenticate:
    """Every request needs the node token, checked from its headers alone (a move's or
    a template's stream, its ticket)."""

    async def check(scope: Scope, headers: Headers) -> None:
        if scope.get("method") == "GET" and _TICKET_STREAM.fullmatch(scope.get("path", "")):
            return
        require_bearer(headers, token, "node token")

    return check


# -- routes --------------------------------------------------------------------------


def _node(request: Request) -> NodeService:
    node: NodeService = request.app.state.node
    return node


Node = Annotated[NodeService, Depends(_node)]
_router = APIRouter()


@_router.get("/info")
async def _info(node: Node) -> Any:
    return encode(await node.info())


@_router.post("/sandboxes", status_code=201)
async def _create(node: Node, request: Request) -> Any:
    spec = decode(SandboxSpec, await request.json())
    return encode(await node.create_sandbox(spec))


@_router.get("/sandboxes")
async def _list(node: Node) -> Any:
    return [encode(status) for status in await node.list_sandboxes()]


@_router.get("/sandboxes/{sandbox_id}")
async def _get(node: Node, sandbox_id: str) -> Any:
    return encode(await node.get_sandbox(sandbox_id))


@_router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def _delete(node: Node, sandbox_id: str) -> Response:
    await node.delete_sandbox(sandbox_id)
    return Response(status_code=204)


@_router.post("/sandboxes/{sandbox_id}/pause")
async def _pause(node: Node, sandbox_id: str) -> Any:
    return encode(await node.pause_sandbox(sandbox_id))


@_router.post("/sandboxes/{sandbox_id}/resume")
async def _resume(node: Node, sandbox_id: str) -> Any:
    return encode(await node.resume_sandbox(sandbox_id))


@_router.post("/sandboxes/{sandbox_id}/hibernate")
async def _hibernate(node: Node, sandbox_id: str) -> Any:
    return encode(await node.hibernate_sandbox(sandbox_id))


@_router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def _snapshot(node: Node, sandbox_id: str, request: Request) -> Any:
    snapshot_id = decode_snapshot_id(await request.json())
    return encode(await node.snapshot_sandbox(sandbox_id, snapshot_id))


@_router.post("/sandboxes/{sandbox_id}/restore")
async def _restore(node: Node, sandbox_id: str, request: Request) -> Any:
    snapshot_id = decode_snapshot_id(await request.json())
    return encode(await node.restore_sandbox(sandbox_id, snapshot_id))


@_router.post("/sandboxes/{sandbox_id}/fork")
async def _fork(node: Node, sandbox_id: str, request: Request) -> Any:
    child_ids = decode_child_ids(await request.json())
    children = await node.fork_sandbox(sandbox_id, child_ids)
    return {"sandboxes": [encode(status) for status in children]}


@_router.get("/snapshots")
async def _list_snapshots(node: Node) -> Any:
    return {"snapshots": [encode(info) for info in await node.list_snapshots()]}


@_router.get("/snapshots/{snapshot_id}")
async def _get_snapshot(node: Node, snapshot_id: str) -> Any:
    return encode(await node.get_snapshot(snapshot_id))


@_router.delete("/snapshots/{snapshot_id}", status_code=204)
async def _delete_snapshot(node: Node, snapshot_id: str) -> Response:
    await node.delete_snapshot(snapshot_id)
    return Response(status_code=204)


@_router.post("/sandboxes/{sandbox_id}/exec")
async def _exec(node: Node, sandbox_id: str, request: Request) -> StreamingResponse:
    stream = await node.exec(sandbox_id, decode_exec_request(await request.json()))
    return StreamingResponse(ndjson_lines(stream), media_type=NDJSON)


@_router.get("/sandboxes/{sandbox_id}/processes")
async def _processes(node: Node, sandbox_id: str) -> Any:
    return [encode(info) for info in await node.list_processes(sandbox_id)]


@_router.get("/sandboxes/{sandbox_id}/metrics")
async def _metrics(node: Node, sandbox_id: str) -> Any:
    return {"samples": [encode(sample) for sample in await node.sandbox_metrics(sandbox_id)]}


@_router.get("/sandboxes/{sandbox_id}/processes/attach")
async def _attach_selected(
    node: Node, sandbox_id: str, pid: int | None = None, tag: str | None = None
) -> StreamingResponse:
    """Attach to the running process with ``?pid=`` or ``?tag=`` (one guest request)."""
    stream = await node.attach(sandbox_id, ProcessSelector(pid=pid, tag=tag))
    return StreamingResponse(ndjson_lines(stream), media_type=NDJSON)


@_router.get("/sandboxes/{sandbox_id}/processes/{process_id}/attach")
async def _attach(node: Node, sandbox_id: str, process_id: str) -> StreamingResponse:
    stream = await node.attach(sandbox_id, process_id)
    return StreamingResponse(ndjson_lines(stream), media_type=NDJSON)


@_router.post("/sandboxes/{sandbox_id}/processes/{process_id}/kill", status_code=204)
async def _kill(node: Node, sandbox_id: str, process_id: str, request: Request) -> Response:
    body = await request.json()
    signal = body.get("signal", 9) if isinstance(body, dict) else None
    if not isinstance(signal, int):
        raise InvalidArgument("signal must be an integer")
    await node.kill_process(sandbox_id, process_id, signal)
    return Response(status_code=204)


@_router.post("/sandboxes/{sandbox_id}/processes/{process_id}/stdin")
async def _stdin(
    node: Node, sandbox_id: str, process_id: str, request: Request, eof: bool = False
) -> Any:
    """The raw body to the process's stdin (the edge bounds it; the channel checks it
    against MAX_INPUT_BYTES); ``?eof=true`` closes stdin after it."""
    data = await request.body()
    return {"bytes": await node.write_stdin(sandbox_id, process_id, data, eof=eof)}


@_router.post("/sandboxes/{sandbox_id}/processes/{process_id}/resize", status_code=204)
async def _resize(node: Node, sandbox_id: str, process_id: str, request: Request) -> Response:
    await node.resize_pty(sandbox_id, process_id, decode_pty_size(await request.json()))
    return Response(status_code=204)


@_router.websocket("/sandboxes/{sandbox_id}/ports/{port}/tunnel")
async def _port_tunnel(websocket: WebSocket, sandbox_id: str, port: int) -> None:
    app = websocket.app
    await serve_tunnel(websocket, app.state.node, app.state.node_token, sandbox_id, port)


@_router.get("/sandboxes/{sandbox_id}/files")
async def _read(node: Node, sandbox_id: str, path: str, user: str = "user") -> StreamingResponse:
    reader = await node.read_file(sandbox_id, path, user)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in reader:
                yield chunk
        finally:
            await reader.aclose()

    headers = {
        FILE_STAT_HEADER: json.dumps(encode(reader.stat)),
        "Content-Length": str(reader.stat.size),
    }
    return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)


async def _chunks(request: Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        if chunk:
            yield chunk


@_router.put("/sandboxes/{sandbox_id}/files")
async def _write(
    node: Node, sandbox_id: str, path: str, request: Request, user: str = "user", mode: int = 0o644
) -> Any:
    stat = await node.write_file(sandbox_id, path, _chunks(request), user=user, mode=mode)
    return encode(stat)


@_router.get("/sandboxes/{sandbox_id}/files/watch")
async def _watch(
    node: Node, sandbox_id: str, path: str, recursive: bool = False, user: str = "user"
) -> StreamingResponse:
    stream = await node.watch_dir(sandbox_id, path, recursive=recursive, user=user)
    return StreamingResponse(watch_lines(stream), media_type=NDJSON)


@_router.get("/sandboxes/{sandbox_id}/files/list")
async def _list_dir(node: Node, sandbox_id: str, path: str, user: str = "user") -> Any:
    return [encode(stat) for stat in await node.list_dir(sandbox_id, path, user)]


@_router.get("/sandboxes/{sandbox_id}/files/stat")
async def _stat(node: Node, sandbox_id: str, path: str, user: str = "user") -> Any:
    return encode(await node.stat(sandbox_id, path, user))


@_router.delete("/sandboxes/{sandbox_id}/files", status_code=204)
async def _remove(node: Node, sandbox_id: str, path: str, recursive: bool = False) -> Response:
    await node.remove(sandbox_id, path, recursive=recursive)
    return Response(status_code=204)


def _str_field(body: object, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string")
    return value


@_router.post("/sandboxes/{sandbox_id}/files/mkdir")
async def _mkdir(node: Node, sandbox_id: str, request: Request) -> Any:
    body = await request.json()
    user = body.get("user", "user") if isinstance(body, dict) else "user"
    return encode(await node.make_dir(sandbox_id, _str_field(body, "path"), str(user)))


@_router.post("/sandboxes/{sandbox_id}/files/rename")
async def _rename(node: Node, sandbox_id: str, request: Request) -> Any:
    body = await request.json()
    user = body.get("user", "user") if isinstance(body, dict) else "user"
    src, dst = _str_field(body, "src"), _str_field(body, "dst")
    return encode(await node.rename(sandbox_id, src, dst, str(user)))


@_router.put("/sandboxes/{sandbox_id}/egress", status_code=204)
async def _set_egress(node: Node, sandbox_id: str, request: Request) -> Response:
    await node.set_egress(sandbox_id, decode_egress_policy(await request.json()))
    return Response(status_code=204)


@_router.put("/sandboxes/{sandbox_id}/secrets", status_code=204)
async def _set_secrets(node: Node, sandbox_id: str, request: Request) -> Response:
    # The body holds values: decode_grants' and the node's errors never quote them.
    await node.set_secrets(sandbox_id, decode_grants(await request.json()))
    return Response(status_code=204)


@_router.get("/sandboxes/{sandbox_id}/egress/log")
async def _egress_log(
    node: Node,
    sandbox_id: str,
    limit: Annotated[int, Query(ge=1, le=MAX_EGRESS_LOG_EVENTS)] = 100,
) -> Any:
    read = await node.egress_log(sandbox_id, limit=limit)
    return {"events": [encode(event) for event in read.events], "dropped": read.dropped}


# moves (issue 19)


@_router.post("/sandboxes/{sandbox_id}/export")
async def _export(node: Node, sandbox_id: str) -> Any:
    return encode(await node.export_sandbox(sandbox_id))


@_router.get("/exports/{sandbox_id}/stream")
async def _export_stream(
    node: Node, sandbox_id: str, request: Request, parent: str | None = None
) -> StreamingResponse:
    ticket = _ticket(request, "a move's stream takes its export ticket", sandbox_id)
    return await _ticket_stream(node.stream_export(sandbox_id, ticket, parent))


def _ticket(request: Request, refusal: str, sandbox_id: str | None = None) -> str:
    scheme, _, ticket = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not ticket:
        raise PermissionDenied(refusal, sandbox_id=sandbox_id)
    return ticket


async def _ticket_stream(stream: AsyncIterator[bytes]) -> StreamingResponse:
    first = await anext(stream)  # the ticket and parent are checked before the answer

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for chunk in stream:
            yield chunk

    return StreamingResponse(body(), media_type="application/octet-stream")


@_router.post("/imports")
async def _import(node: Node, request: Request) -> Any:
    body = await request.json()
    source_url = _str_field(body, "source_url")
    if not isinstance(body, dict) or not isinstance(body.get("ticket"), dict):
        raise InvalidArgument("an import takes {ticket, source_url}")
    ticket = decode(ExportTicket, body["ticket"])
    return encode(await node.import_sandbox(ticket, source_url))


@_router.post("/sandboxes/{sandbox_id}/export/finish", status_code=204)
async def _finish_export(node: Node, sandbox_id: str, request: Request) -> Response:
    body = await request.json()
    moved = body.get("moved") if isinstance(body, dict) else None
    if not isinstance(moved, bool):
        raise InvalidArgument("finishing an export takes {ticket, moved}")
    await node.finish_export(sandbox_id, _str_field(body, "ticket"), moved=moved)
    return Response(status_code=204)


# archives (issue 19): bundle names hold "/", so they travel in bodies, not paths.


@_router.post("/snapshots/{snapshot_id}/archive", status_code=204)
async def _archive_snapshot(node: Node, snapshot_id: str) -> Response:
    await node.archive_snapshot(snapshot_id)
    return Response(status_code=204)


@_router.post("/snapshots/{snapshot_id}/fetch")
async def _fetch_snapshot(node: Node, snapshot_id: str) -> Any:
    return encode(await node.fetch_snapshot(snapshot_id))


@_router.post("/sandboxes/{sandbox_id}/archive")
async def _archive_sandbox(node: Node, sandbox_id: str) -> Any:
    return encode(await node.archive_sandbox(sandbox_id))


@_router.post("/sandboxes/{sandbox_id}/import-archive")
async def _import_archive(node: Node, sandbox_id: str, request: Request) -> Any:
    archive = _str_field(await request.json(), "archive")
    return encode(await node.import_archive(sandbox_id, archive))


@_router.post("/archives/delete", status_code=204)
async def _delete_archive(node: Node, request: Request) -> Response:
    await node.delete_archive(_str_field(await request.json(), "name"))
    return Response(status_code=204)


@_router.post("/templates/imports")
async def _import_template(node: Node, request: Request) -> Any:
    body = await request.json()
    source_url = _str_field(body, "source_url")
    if not isinstance(body, dict) or not isinstance(body.get("ticket"), dict):
        raise InvalidArgument("a template import takes {ticket, source_url}")
    ticket = decode(TemplateTicket, body["ticket"])
    return encode(await node.import_template(ticket, source_url))


@_router.post("/templates/{ref}/export")
async def _export_template(node: Node, ref: str) -> Any:
    return encode(await node.export_template(ref))


@_router.get("/template-exports/{digest}/stream")
async def _template_stream(
    node: Node, digest: str, request: Request, parent: str | None = None
) -> StreamingResponse:
    ticket = _ticket(request, "a template's stream takes its ticket")
    return await _ticket_stream(node.stream_template(digest, ticket, parent))


@_router.post("/templates/builds")
async def _build(node: Node, request: Request) -> StreamingResponse:
    # A bad archive or spec raises here, before the first event: the error JSON answers.
    stream = await node.build_template(_chunks(request))
    headers = {BUILD_ID_HEADER: stream.build_id}
    return StreamingResponse(build_lines(stream), media_type=NDJSON, headers=headers)


@_router.get("/templates")
async def _list_templates(node: Node) -> Any:
    return encode_templates(await node.list_templates())


# A plain parameter takes any one path segment, ':' and '@' included (name:tag, name@digest).
@_router.delete("/templates/{ref}", status_code=204)
async def _delete_template(node: Node, ref: str) -> Response:
    await node.delete_template(ref)
    return Response(status_code=204)


def create_node_app(node: NodeService, token: str) -> FastAPI:
    """The node's HTTP API over ``node``, for callers presenting ``token``.

    The app neither starts nor closes ``node``: its owner does.
    """
    if not token:
        raise ValueError("the node API needs a non-empty token")
    app = FastAPI(title="SPACE node", docs_url=None, redoc_url=None)
    app.state.node = node
    app.state.node_token = token
    app.include_router(_router, prefix=NODE_API_PREFIX)
    install_error_handlers(app, handlers_parse_bodies=True)
    app.add_middleware(
        Edges,
        authenticate=_token_check(token),
        streamed_routes=STREAMED_ROUTES,
        max_body_bytes=MAX_NODE_JSON_BODY_BYTES,
    )
    return app


def node_server(
    app: FastAPI,
    *,
    host: str,
    port: int,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
    tls: tuple[Path, Path] | None = None,
) -> uvicorn.Server:
    """A uvicorn server for the node's API ``app`` on ``host:port`` (not yet serving),
    over HTTPS with ``tls`` (the PEM certificate chain and key files): moves and
    template shipments stream between nodes through it.

    Its connections are bounded as the control plane's (space.node.api.http_connections):
    headers complete within ``header_timeout_s``, at most 64 KiB of them, and at most
    ``max_connections_per_client`` open connections per client address.
    """
    http = guarded_protocol(
        header_timeout_s=header_timeout_s, max_per_client=max_connections_per_client
    )
    cert, key = (None, None) if tls is None else (str(tls[0]), str(tls[1]))
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", http=http, ssl_certfile=cert, ssl_keyfile=key
    )
    return uvicorn.Server(config)
