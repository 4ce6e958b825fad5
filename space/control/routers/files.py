"""``/v1/sandboxes/{id}/files``: streamed upload and download, and file operations.

Uploads are handed to the node chunk by chunk as they arrive and downloads leave as
the node produces them, so no file sits whole in the control plane's memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from space.control.deps import Context, LiveSandbox
from space.control.node_text import scrub
from space.control.schemas import FileStatOut, GuestPath, MkdirBody, RenameBody, UserName
from space.node.api import NDJSON, FileReader, watch_lines

__all__ = ["download", "router"]

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/files", tags=["files"])

PathQuery = Annotated[GuestPath, Query()]
UserQuery = Annotated[UserName, Query()]
ModeQuery = Annotated[str, Query(pattern=r"^[0-7]{1,4}$")]


async def _upload(request: Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        if chunk:
            yield chunk


@router.put("")
async def write_file(
    request: Request,
    sandbox: LiveSandbox,
    ctx: Context,
    path: PathQuery,
    mode: ModeQuery = "644",
    user: UserQuery = "user",
) -> FileStatOut:
    node = ctx.nodes.get(sandbox.node_id)
    stat = await node.write_file(sandbox.id, path, _upload(request), user=user, mode=int(mode, 8))
    return FileStatOut.of(stat)


async def download(reader: FileReader) -> AsyncIterator[bytes]:
    """The file's bytes, never past the size its stat (the Content-Length) said: a
    guest that sends more (a file that grew, or a lying guest) is cut there."""
    left = reader.stat.size
    try:
        async for chunk in reader:
            if left <= 0:
                break
            yield chunk[:left]
            left -= len(chunk)
    finally:
        await reader.aclose()


@router.get("", response_class=StreamingResponse)
async def read_file(
    sandbox: LiveSandbox, ctx: Context, path: PathQuery, user: UserQuery = "user"
) -> StreamingResponse:
    reader = await ctx.nodes.get(sandbox.node_id).read_file(sandbox.id, path, user)
    headers = {"Content-Length": str(reader.stat.size)}
    return StreamingResponse(
        download(reader), media_type="application/octet-stream", headers=headers
    )


@router.get("/list")
async def list_dir(
    sandbox: LiveSandbox, ctx: Context, path: PathQuery, user: UserQuery = "user"
) -> dict[str, list[FileStatOut]]:
    entries = await ctx.nodes.get(sandbox.node_id).list_dir(sandbox.id, path, user)
    return {"entries": [FileStatOut.of(stat) for stat in entries]}


@router.get("/watch")
async def watch_dir(
    sandbox: LiveSandbox,
    ctx: Context,
    path: PathQuery,
    recursive: bool = False,
    user: UserQuery = "user",
) -> StreamingResponse:
    """The directory's changes as NDJSON until the client goes (the watch is then
    released in the guest); an open watch counts as activity, as an exec stream does."""
    node = ctx.nodes.get(sandbox.node_id)
    stream = await node.watch_dir(sandbox.id, path, recursive=recursive, user=user)
    lines = ctx.activity.watch(sandbox.id, watch_lines(stream, scrub))
    return StreamingResponse(lines, media_type=NDJSON)


@router.get("/stat")
async def stat(
    sandbox: LiveSandbox, ctx: Context, path: PathQuery, user: UserQuery = "user"
) -> FileStatOut:
    return FileStatOut.of(await ctx.nodes.get(sandbox.node_id).stat(sandbox.id, path, user))


@router.delete("", status_code=204)
async def remove(
    sandbox: LiveSandbox, ctx: Context, path: PathQuery, recursive: bool = False
) -> Response:
    await ctx.nodes.get(sandbox.node_id).remove(sandbox.id, path, recursive=recursive)
    return Response(status_code=204)


@router.post("/mkdir")
async def make_dir(body: MkdirBody, sandbox: LiveSandbox, ctx: Context) -> FileStatOut:
    node = ctx.nodes.get(sandbox.node_id)
    return FileStatOut.of(await node.make_dir(sandbox.id, body.path, body.user))


@router.post("/rename")
async def rename(body: RenameBody, sandbox: LiveSandbox, ctx: Context) -> FileStatOut:
    node = ctx.nodes.get(sandbox.node_id)
    return FileStatOut.of(await node.rename(sandbox.id, body.src, body.dst, body.user))
