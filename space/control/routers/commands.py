"""``/v1/sandboxes/{id}/exec`` and ``/processes``: NDJSON streams of process events, and
a running process's stdin and PTY size (issue 20)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import StreamingResponse

from space.control.deps import Context, LiveSandbox
from space.control.node_text import scrub
from space.control.schemas import ExecBody, KillBody, ProcessOut, PtyBody
from space.limits import PROCESS_TAG_PATTERN
from space.node.api import NDJSON, ExecRequest, PtySize, ndjson_lines

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
        open_stdin=body.open_stdin,
        pty=None if body.pty is None else PtySize(rows=body.pty.rows, cols=body.pty.cols),
        tag=body.tag,
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
async def list_processes(
    sandbox: LiveSandbox,
    ctx: Context,
    tag: Annotated[str | None, Query(pattern=f"^{PROCESS_TAG_PATTERN}$")] = None,
) -> dict[str, list[ProcessOut]]:
    """The sandbox's processes; ``?tag=`` keeps those started with that tag."""
    infos = await ctx.nodes.get(sandbox.node_id).list_processes(sandbox.id)
    kept = [info for info in infos if tag is None or info.tag == tag]
    return {"processes": [ProcessOut.of(info) for info in kept]}


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


@router.post("/processes/{process_id}/stdin")
async def write_stdin(
    process_id: ProcessId,
    sandbox: LiveSandbox,
    ctx: Context,
    request: Request,
    eof: bool = False,
) -> dict[str, int]:
    """The raw body (at most 1 MiB: the edge refuses more with 413) to the stdin or
    terminal of a process started with ``open_stdin`` or ``pty``; ``?eof=true`` closes
    it after. Answers once the process took the bytes."""
    data = await request.body()
    node = ctx.nodes.get(sandbox.node_id)
    return {"bytes": await node.write_stdin(sandbox.id, process_id, data, eof=eof)}


@router.post("/processes/{process_id}/resize", status_code=204)
async def resize_pty(
    process_id: ProcessId, body: PtyBody, sandbox: LiveSandbox, ctx: Context
) -> Response:
    size = PtySize(rows=body.rows, cols=body.cols)
    await ctx.nodes.get(sandbox.node_id).resize_pty(sandbox.id, process_id, size)
    return Response(status_code=204)
