"""The node agent's own HTTP API: NodeService under ``/node/v1``, for remote control planes.

``create_node_app(node, token)`` serves every NodeService method; space.node.http.client's
``RemoteNode`` is its client, so a control plane on another host holds that node like a
local one. Bodies are JSON (dataclasses of space.node.api.interface, bytes as base64),
exec/attach answer NDJSON (``start`` line, then events, as docs/api.md), file contents
travel as raw bytes (a read's FileStat in the ``X-Space-File-Stat`` header). ``/info``
answers NodeInfo, the node's warm pools included. Snapshots live under ``/snapshots``
(node-wide: a snapshot outlives its sandbox); taking, restoring and forking are POSTs on
the sandbox (``/snapshots``, ``/restore``, ``/fork``). Templates live under ``/templates``:
``POST /templates/builds`` takes the build context (a tar, plain or gzip'd) as its raw
body and answers the build's NDJSON events (its id in ``X-Build-Id``); ``GET`` lists,
``DELETE /templates/{ref}`` deletes (``name``, ``name:tag``, ``name@digest``). A
sandbox's egress policy is ``PUT /sandboxes/{id}/egress`` with ``{"policy": {...} |
null}`` (204); ``GET /sandboxes/{id}/egress/log?limit=N`` (1 to MAX_EGRESS_LOG_EVENTS,
default 100) answers ``{"events": [EgressEvent, ...]}``, oldest first. Its secret
grants are ``PUT /sandboxes/{id}/secrets`` with ``{"grants": [SecretGrant, ...]}``
(204); that body holds secret values, so no body is ever logged here. Errors
answer ``{"error": {"code", "message", "details"}}`` with the status of
``STATUS_BY_CODE`` (space.node.api.http_errors, shared with the control plane). Every
request needs ``Authorization: Bearer <node token>``.

The JSON and NDJSON shapes live in space.node.api.wire, shared with RemoteNode and the
control plane.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from space.node.api import (
    BUILD_ID_HEADER,
    FILE_STAT_HEADER,
    MAX_EGRESS_LOG_EVENTS,
    NDJSON,
    NODE_API_PREFIX,
    InvalidArgument,
    NodeService,
    SandboxSpec,
    build_lines,
    decode,
    decode_child_ids,
    decode_egress_policy,
    decode_exec_request,
    decode_grants,
    decode_snapshot_id,
    encode,
    encode_templates,
    ndjson_lines,
)
from space.node.api.http_errors import install_error_handlers

__all__ = ["create_node_app"]

T = TypeVar("T")


# -- auth -----------------------------------------------------------------


def _auth_dependency(token: str) -> Any:
    expected = f"Bearer {token}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise StarletteHTTPException(401, "missing or wrong node token")

    return Depends(check)


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
    return {"events": [encode(event) for event in await node.egress_log(sandbox_id, limit=limit)]}


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
    app.include_router(_router, prefix=NODE_API_PREFIX, dependencies=[_auth_dependency(token)])
    install_error_handlers(app, handlers_parse_bodies=True)
    return app
