"""``/v1/sandboxes/{id}/exec`` and ``/processes``: NDJSON streams of process events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response
from fastapi.responses import StreamingResponse

from space.control.deps import Context, LiveSandbox
from space.control.node_text import scrub
from space.control.schemas import ExecBody, KillBody, ProcessOut
from space.node.api import NDJSON, ExecRequest, ndjson_lines

__all__ = ["router"]

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", tags=["commands"])

ProcessId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


def _exec_request(body: ExecBody) -> ExecRequest:
    return ExecRequest(
        argv=body.argv,
        cmd=body.cmd,
        env=dict(body.env),
        cwd=body.cwd,
        user=body.user,
        timeout_s=body.timeout_s,
        background=body.background,
        stdin=None if body.stdin is None else body.stdin.encode(),
    )


@router.post("/exec")
async def exec_command(body: ExecBody, sandbox: LiveSandbox, ctx: Context) -> StreamingResponse:
    """Start a process; errors before it starts are HTTP errors, later ones NDJSON lines.

    A client that disconnects closes the stream: a foreground process is killed. The
    sandbox counts as active while the stream is open (space.control.activity).
    """
    node = ctx.nodes.get(sandbox.node_id)
    with ctx.metrics.timing_exec_start():
        stream = await node.exec(sandbox.id, _exec_request(body))
    lines = ctx.activity.watch(sandbox.id, ndjson_lines(stream, scrub))
    return StreamingResponse(lines, media_type=NDJSON)


@router.get("/processes")
async def list_processes(sandbox: LiveSandbox, ctx: Context) -> dict[str, list[ProcessOut]]:
    infos = await ctx.nodes.get(sandbox.node_id).list_processes(sandbox.id)
    return {"processes": [ProcessOut.of(info) for info in infos]}


@router.get("/processes/{process_id}/stream")
async def stream_process(
    process_id: ProcessId, sandbox: LiveSandbox, ctx: Context
) -> StreamingResponse:
    """The process's buffered output, then live events, as NDJSON (like exec)."""
    stream = await ctx.nodes.get(sandbox.node_id).attach(sandbox.id, process_id)
    lines = ctx.activity.watch(sandbox.id, ndjson_lines(stream, scrub))
    return StreamingResponse(lines, media_type=NDJSON)


@router.post("/processes/{process_id}/kill", status_code=204)
async def kill_process(
    process_id: ProcessId, sandbox: LiveSandbox, ctx: Context, body: KillBody | None = None
) -> Response:
    signal = body.signal if body is not None else 9
    await ctx.nodes.get(sandbox.node_id).kill_process(sandbox.id, process_id, signal)
    return Response(status_code=204)
