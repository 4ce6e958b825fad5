"""``/v1/templates``: build (NDJSON log), list and delete a tenant's templates (issue 4).

Placement (issue 19): a build runs once, on the node placement ranks first among
those other nodes reach, and is then shipped to the others in the background
(space.control.shipping); an embedded node (which no other node reaches) builds for
itself, from the same spooled copy of the context. The build succeeds only if every
node that builds it succeeds. Names are scoped by tenant on the nodes
(space.control.template_names); ``base`` is shared and read-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tomllib
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session
from starlette.background import BackgroundTask

from space.control import quota_checks
from space.control.build_context import (
    MAX_UPLOAD_BYTES,
    Binary,
    file_chunks,
    rewrite_context,
    spool_upload,
)
from space.control.deps import Context, ControlContext, Tenant
from space.control.errors import ApiError
from space.control.node_text import scrub
from space.control.quotas import BuildSlot
from space.control.scheduler import rank_nodes
from space.control.schemas import TemplateOut
from space.control.shipping import ship_after_build
from space.control.store import nodes as node_rows
from space.control.store import repo
from space.control.template_names import (
    BASE,
    REF_PATTERN,
    node_ref,
    parse_ref,
    tenant_name,
)
from space.control.template_spec import rewrite_spec
from space.node.api import (
    NDJSON,
    BuildEvent,
    BuildFailed,
    BuildLog,
    BuildStream,
    BuildSucceeded,
    NodeError,
    NotFound,
    TemplateInfo,
)

__all__ = ["router"]

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/templates", tags=["templates"])

# Bounds the log lines waiting between the nodes' builds and a slow client.
_QUEUE_EVENTS = 64

TemplateRefPath = Annotated[str, Path(pattern=REF_PATTERN, max_length=129)]


@router.post("", response_class=StreamingResponse)
async def build_template(request: Request, tenant: Tenant, ctx: Context) -> StreamingResponse:
    """Build the uploaded context on every node; NDJSON ``log`` lines, then the result.

    Errors before any node starts building (size, archive, spec, names) are ordinary
    JSON errors; a build that fails ends the stream with an ``error`` line. A client
    that disconnects stops listening only: the builds finish on their nodes.
    """
    _check_declared_length(request)
    node_ids = await _build_nodes(ctx)
    # From the headers alone: a tenant at its builds quota has no byte of its context read.
    slot = await quota_checks.take_build(ctx, tenant)
    try:
        context = await _spool_context(ctx, tenant, node_ids, request)
    except BaseException:
        slot.release()
        raise
    try:
        streams = await _start_builds(ctx, tenant, node_ids, context)
    except BaseException:
        context.close()
        slot.release()
        raise
    lines = _build_lines(ctx, tenant, streams, context, slot)
    # The stream frees the slot as it ends; the background task too, for a response
    # whose stream never started (its client left first).
    return StreamingResponse(lines, media_type=NDJSON, background=BackgroundTask(slot.release))


async def _spool_context(
    ctx: ControlContext, tenant: str, node_ids: list[str], request: Request
) -> Binary:
    """The uploaded context, its spec in the nodes' names, spooled to a file; refused
    (429) if it would add a ``name:tag`` past the tenant's ``templates`` quota."""
    visible = await _visible_digests(ctx, tenant, node_ids)
    named: list[tuple[str, str]] = []

    def edit(data: bytes) -> bytes:
        named.append(_spec_name(data))
        return rewrite_spec(data, tenant=tenant, visible_digests=visible)

    raw = await spool_upload(request.stream(), MAX_UPLOAD_BYTES)
    try:
        context = await asyncio.to_thread(rewrite_context, raw, edit)
    finally:
        raw.close()
    try:
        if named:
            await quota_checks.check_new_template(ctx, tenant, *named[-1])
    except BaseException:
        context.close()
        raise
    return context


def _spec_name(data: bytes) -> tuple[str, str]:
    """The ``(name, tag)`` a spec builds, as the tenant wrote them (rewrite_spec, which
    runs next, refuses a spec where they are missing or malformed)."""
    with contextlib.suppress(UnicodeDecodeError, tomllib.TOMLDecodeError):
        document = tomllib.loads(data.decode("utf-8"))
        return str(document.get("name", "")), str(document.get("tag", "latest"))
    return "", "latest"


@router.get("")
async def list_templates(tenant: Tenant, ctx: Context) -> dict[str, list[TemplateOut]]:
    """The tenant's templates and base, one per name and tag, sorted; read-only.

    A node that does not answer in time is left out (and logged; NodeRegistry.templates);
    with no node registered the list is empty.
    """
    found: dict[tuple[str, str], TemplateOut] = {}
    for node_id in ctx.nodes.ids():
        for info in await ctx.nodes.templates(node_id):
            out = _out(tenant, info)
            if out is not None:
                found.setdefault((out.name, out.tag), out)
    return {"templates": [found[key] for key in sorted(found)]}


@router.delete("/{ref}", status_code=204)
async def delete_template(ref: TemplateRefPath, tenant: Tenant, ctx: Context) -> Response:
    """Delete ``name`` / ``name:tag`` (that tag) or ``name@digest`` (its tags) everywhere.

    Sandboxes made from it are unaffected. 409 for base; 404 if no node has it.
    """
    if parse_ref(ref).name == BASE:
        raise ApiError("conflict", "the template 'base' is shared and read-only", template=BASE)
    target, deleted = node_ref(tenant, ref), False
    for node_id in _all_nodes(ctx):
        try:
            await ctx.nodes.get(node_id).delete_template(target)
            deleted = True
        except NotFound:
            continue
    if not deleted:
        raise ApiError("not_found", f"no template {ref!r}", template=ref)
    return Response(status_code=204)


def _check_declared_length(request: Request) -> None:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_UPLOAD_BYTES:
        raise ApiError(
            "resource_exhausted",
            f"build context larger than the {MAX_UPLOAD_BYTES}-byte limit",
            limit_bytes=MAX_UPLOAD_BYTES,
            observed_bytes=int(declared),
        )


async def _build_nodes(ctx: ControlContext) -> list[str]:
    """Where a build runs: every embedded node, and the first in placement order of
    the others (which get it shipped). ApiError(unavailable) with no node."""
    node_ids = _all_nodes(ctx)
    embedded = set(ctx.nodes.embedded())

    def read(session: Session) -> tuple[list[node_rows.NodeRecord], dict[str, int]]:
        return node_rows.list_nodes(session), repo.active_counts(session)

    records, load = await ctx.db.run(read)
    ranked = rank_nodes(records, load, reachable=node_ids)
    others = [n for n in ranked + node_ids if n not in embedded]
    return [n for n in node_ids if n in embedded] + others[:1]


def _all_nodes(ctx: ControlContext) -> list[str]:
    node_ids = ctx.nodes.ids()
    if not node_ids:
        raise ApiError("unavailable", "no node is registered to build templates")
    return node_ids


async def _visible_digests(ctx: ControlContext, tenant: str, node_ids: list[str]) -> set[str]:
    """Digests of base's and the tenant's builds: what a ``template@`` base may name."""
    infos = [info for node_id in node_ids for info in await ctx.nodes.get(node_id).list_templates()]
    return {info.digest for info in infos if tenant_name(tenant, info.name) is not None}


def _out(tenant: str, info: TemplateInfo) -> TemplateOut | None:
    name = tenant_name(tenant, info.name)
    if name is None:
        return None
    return TemplateOut.of(info, name=name, base=_tenant_base(tenant, info.base))


def _tenant_base(tenant: str, base: str) -> str:
    if base.startswith("template:"):
        name, _, tag = base.removeprefix("template:").partition(":")
        return f"template:{tenant_name(tenant, name) or name}:{tag}"
    return base


async def _start_builds(
    ctx: ControlContext, tenant: str, node_ids: list[str], context: Binary
) -> dict[str, BuildStream]:
    """Start the build on each node in turn (each reads the whole context first)."""
    streams: dict[str, BuildStream] = {}
    try:
        for node_id in node_ids:
            node = ctx.nodes.get(node_id)
            streams[node_id] = await node.build_template(file_chunks(context))
    except NodeError as exc:
        exc.message = scrub(exc.message)
        await _close_all(streams)
        raise
    except BaseException:
        await _close_all(streams)
        raise
    return streams


async def _close_all(streams: Mapping[str, BuildStream]) -> None:
    for stream in streams.values():
        await stream.aclose()


_Item = tuple[str, BuildEvent | None]


async def _pump(node_id: str, stream: BuildStream, queue: asyncio.Queue[_Item]) -> None:
    """Every event of one node's build into ``queue``, then ``None``; errors as BuildFailed."""
    try:
        async for event in stream:
            await queue.put((node_id, event))
    except NodeError as exc:
        await queue.put((node_id, BuildFailed(exc.code, exc.message)))
    except Exception as exc:
        log.exception("template build stream of node %s failed", node_id)
        await queue.put((node_id, BuildFailed("internal", f"stream failed: {type(exc).__name__}")))
    await queue.put((node_id, None))


async def _build_lines(
    ctx: ControlContext,
    tenant: str,
    streams: dict[str, BuildStream],
    context: Binary,
    slot: BuildSlot,
) -> AsyncIterator[bytes]:
    """Log lines as they come from any node (prefixed by node id if several), then one
    ``template`` or ``error`` line; a build that succeeded is shipped to the other nodes
    in the background. Closing it early closes the streams and the context; ending
    either way frees the tenant's build slot."""
    queue: asyncio.Queue[_Item] = asyncio.Queue(_QUEUE_EVENTS)
    pumps = [asyncio.create_task(_pump(n, s, queue)) for n, s in streams.items()]
    prefix = len(streams) > 1
    outcomes: dict[str, BuildEvent] = {}
    try:
        for _ in pumps:
            while (item := await queue.get())[1] is not None:
                node_id, event = item
                if isinstance(event, BuildLog):
                    yield _line({"type": "log", "line": _says(node_id, event.line, prefix)})
                elif event is not None:
                    outcomes[node_id] = event
        built = [o for o in outcomes.values() if isinstance(o, BuildSucceeded)]
        if len(built) == len(streams):
            ship_after_build(ctx, built[0].template.digest)
        yield _line(_result(tenant, list(streams), outcomes, prefix))
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await _close_all(streams)
        context.close()
        slot.release()


def _result(
    tenant: str, node_ids: list[str], outcomes: Mapping[str, BuildEvent], prefix: bool
) -> dict[str, Any]:
    """The last line: the first failure by node id, else the first node's template."""
    lost = BuildFailed("internal", "the node's build ended without a result")
    results = [(node_id, outcomes.get(node_id, lost)) for node_id in node_ids]
    for node_id, outcome in results:
        if isinstance(outcome, BuildFailed):
            message = _says(node_id, outcome.message, prefix)
            return {"type": "error", "code": outcome.code, "message": message, "step": outcome.step}
    built = next(o for _, o in results if isinstance(o, BuildSucceeded))
    out = _out(tenant, built.template)
    if out is None:  # a node named the build otherwise than asked: never show it
        return {"type": "error", "code": "internal", "message": "unexpected template name"}
    return {"type": "template", "template": out.model_dump()}


def _says(node_id: str, text: str, prefix: bool) -> str:
    text = scrub(text)
    return f"[{node_id}] {text}" if prefix else text


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"
