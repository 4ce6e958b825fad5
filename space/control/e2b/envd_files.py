"""envd's plain HTTP routes: ``GET /health``, ``GET /files`` and ``POST /files``.

- ``GET /health``: 204 while the sandbox runs or can be resumed (nothing is resumed
  for it), 502 otherwise: the SDK's probe after a failed request.
- ``GET /files?path=&username=``: the file, streamed as the node reads it
  (space.control.routers.files.download: never past the size its stat said).
- ``POST /files?path=&username=``: ``application/octet-stream`` (one file, the body)
  or ``multipart/form-data`` (each ``file`` part one file, named by its filename, or
  by ``path`` for a single part), each streamed to the node as it arrives, as our own
  upload (``PUT /v1/sandboxes/{id}/files``) is. Answers ``[{"name", "type", "path"}]``.

Errors answer ``{"code": <status>, "message"}`` with the status the SDK maps to its
exceptions (404 NotFoundException, 400 InvalidArgumentException, 401, 429, 507).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.datastructures import Headers, QueryParams
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from space.control.deps import ControlContext
from space.control.e2b.connect import HTTP_STATUS, Code, ConnectError, connect_error_of
from space.control.e2b.envd_request import checked_user, not_running_message, user_of
from space.control.e2b.multipart import MultipartError, MultipartReader, boundary_of
from space.control.errors import ApiError
from space.control.routers.files import download
from space.control.schemas import MAX_PATH_BYTES
from space.control.store import repo
from space.control.store.repo import SandboxRecord
from space.node.api import FileStat, NodeService, SandboxState
from space.node.api.errors import NodeError

__all__ = ["serve"]

_HEALTHY = frozenset({repo.RUNNING, SandboxState.PAUSED.value, SandboxState.HIBERNATED.value})
#: Statuses our codes answer with here where envd's differ from Connect's mapping (a
#: full disk is envd's 507, which the SDK makes NotEnoughSpaceException).
_STATUS_OVERRIDES = {Code.FAILED_PRECONDITION: 409, Code.UNAVAILABLE: 502}

Live = Callable[[SandboxRecord], Awaitable[SandboxRecord]]


def _error(error: ConnectError) -> Response:
    status = _STATUS_OVERRIDES.get(error.code, HTTP_STATUS[error.code])
    return JSONResponse({"code": status, "message": error.message}, status_code=status)


def _path(query: QueryParams, name: str = "path") -> str:
    path = query.get(name, "")
    if not path or "\0" in path or len(path.encode()) > MAX_PATH_BYTES:
        raise ConnectError(
            Code.INVALID_ARGUMENT, f"{name} must be 1 to {MAX_PATH_BYTES} bytes without NUL"
        )
    return path


def _user(query: QueryParams, headers: Headers) -> str:
    given = query.get("username")
    return user_of(headers) if given is None else checked_user(given)


async def serve(
    ctx: ControlContext,
    record: SandboxRecord,
    scope: Scope,
    receive: Receive,
    send: Send,
    live: Live,
) -> None:
    """Answer one of envd's HTTP routes (the request is authenticated)."""
    route = (scope["method"], scope["path"])
    if route == ("GET", "/health"):
        healthy = record.state in _HEALTHY
        response: Response = (
            Response(status_code=204)
            if healthy
            else JSONResponse({"code": 502, "message": not_running_message(record)}, 502)
        )
    elif route in (("GET", "/files"), ("POST", "/files")):
        try:
            record = await live(record)
            response = await _files(ctx, record, scope, receive)
        except ConnectError as error:
            response = _error(error)
        except (NodeError, ApiError) as exc:
            response = _error(connect_error_of(exc))
        except MultipartError as exc:
            response = _error(ConnectError(Code.INVALID_ARGUMENT, str(exc)))
    else:
        response = JSONResponse({"code": 404, "message": f"no route {scope['path'][:100]}"}, 404)
    await response(scope, receive, send)


async def _files(
    ctx: ControlContext, record: SandboxRecord, scope: Scope, receive: Receive
) -> Response:
    query = QueryParams(scope.get("query_string", b""))
    headers = Headers(scope=scope)
    node = ctx.nodes.get(record.node_id)
    user = _user(query, headers)
    if scope["method"] == "GET":
        reader = await node.read_file(record.id, _path(query), user)
        return StreamingResponse(
            download(reader),
            media_type="application/octet-stream",
            headers={"Content-Length": str(reader.stat.size)},
        )
    if headers.get("content-encoding", "identity").lower() != "identity":
        raise ConnectError(Code.INVALID_ARGUMENT, "compressed uploads are not supported")
    content_type = headers.get("content-type", "")
    if content_type.lower().startswith("multipart/form-data"):
        written = await _multipart(node, record.id, query, user, content_type, receive)
    else:
        written = [await node.write_file(record.id, _path(query), _body(receive), user=user)]
    return JSONResponse([_write_info(stat) for stat in written])


async def _multipart(
    node: NodeService,
    sandbox_id: str,
    query: QueryParams,
    user: str,
    content_type: str,
    receive: Receive,
) -> list[FileStat]:
    reader = MultipartReader(receive, boundary_of(content_type))
    written: list[FileStat] = []
    async for part in reader:
        if part.name != "file":
            continue
        path = query.get("path") if "path" in query else part.filename
        if not path:
            raise ConnectError(Code.INVALID_ARGUMENT, "a file part without a path")
        checked = _path(QueryParams({"path": path}))
        written.append(await node.write_file(sandbox_id, checked, reader.data(), user=user))
    return written


async def _body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectError(Code.CANCELED, "the client went away during the upload")
        if chunk := message.get("body", b""):
            yield chunk
        if not message.get("more_body", False):
            return


def _write_info(stat: FileStat) -> dict[str, Any]:
    kind = {"file": "file", "dir": "dir"}.get(stat.type)
    return {"name": stat.name, "type": kind, "path": stat.path}
