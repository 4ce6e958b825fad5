"""E2B's sandbox routes: create, list, get, kill, timeout, pause, resume and connect,
each on the control-plane functions our ``/v1`` routes call (space.control.lifecycle).

Statuses are those the e2b SDK expects: create 201; connect 200 for a running sandbox
and 201 for one it resumed; resume 201 (409 if it runs); pause 204 (409 if already
paused); kill and timeout 204; an unknown id 404.
"""

from __future__ import annotations

import base64
import binascii
import re
import urllib.parse
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Response
from fastapi.responses import JSONResponse

from space.control import egress, lifecycle
from space.control.deps import Context, ControlContext, Tenant
from space.control.e2b._errors import E2BError, E2BRoute
from space.control.e2b._network import egress_policy, public_traffic
from space.control.e2b._shapes import (
    E2BConnect,
    E2BNetworkUpdate,
    E2BNewSandbox,
    E2BPause,
    E2BResume,
    E2BTimeout,
    auto_pauses,
    created_sandbox,
    e2b_state,
    end_at,
    lifetime_for,
    listed_sandbox,
    sandbox_detail,
)
from space.control.idempotency import HEADER, idempotency
from space.control.node_text import scrub
from space.control.schemas import SandboxCreate
from space.control.store import repo
from space.control.store.repo import SandboxRecord
from space.control.template_names import parse_ref

__all__ = ["MAX_PAGE", "SNAPSHOT_ID", "E2BSandbox", "router", "set_timeout_of"]

router = APIRouter(route_class=E2BRoute, tags=["e2b"])

#: A template id that names one of the tenant's snapshots (space.control.snapshots).
SNAPSHOT_ID = re.compile(r"sn-[0-9a-f]{24}")
#: The most sandboxes one list page holds (E2B's limit).
MAX_PAGE = 100


async def _e2b_sandbox(sandbox_id: str, tenant: Tenant, ctx: Context) -> SandboxRecord:
    """The tenant's sandbox in a state E2B shows; 404 otherwise (another tenant's id
    is exactly a missing one)."""
    record = await ctx.db.read(lambda s: repo.find_sandbox(s, tenant, sandbox_id))
    if record is None:
        raise E2BError(404, f"sandbox {sandbox_id!r} not found")
    if e2b_state(record) is None:
        why = scrub(record.error or "")  # a node's words, without its internal names
        raise E2BError(404, f"sandbox {sandbox_id!r} is {record.state}: {why}")
    return ctx.activity.latest(record)


E2BSandbox = Annotated[SandboxRecord, Depends(_e2b_sandbox)]
#: The SDK's ``idempotency_key`` (space.control.idempotency keeps it as for /v1).
IdempotencyKey = Annotated[str | None, Header(alias=HEADER)]


def _create_body(body: E2BNewSandbox, settings_default_s: int) -> SandboxCreate:
    """Our create request for E2B's; E2BError(400) for what SPACE cannot honour."""
    for name in ("mcp", "iam"):
        if getattr(body, name) is not None:
            raise E2BError(400, f"{name} is not supported by SPACE")
    if body.volumeMounts:
        raise E2BError(400, "volumeMounts is not supported by SPACE")
    if body.autoPause and not body.autoPauseMemory:
        raise E2BError(400, "autoPauseMemory: false (filesystem-only pause) is not supported")
    timeout = body.timeout if body.timeout is not None else settings_default_s
    fields: dict[str, Any] = {
        "env": body.envVars,
        "metadata": body.metadata,
        "egress": egress_policy(body.allow_internet_access, body.network),
        # autoPause: no lifetime; hibernated after ``timeout`` seconds idle (see _shapes).
        "timeout_s": None if body.autoPause else timeout,
        "idle_timeout_s": timeout if body.autoPause else None,
        # E2B's sandbox URLs always reach its ports (get_host, the code interpreter's
        # 49999); ours require the traffic token unless allowPublicTraffic says public.
        "ports": {"enabled": True, "public": public_traffic(body.network)},
    }
    if SNAPSHOT_ID.fullmatch(body.templateID):
        fields["from_snapshot"] = body.templateID
    else:
        fields["template"] = body.templateID
    return SandboxCreate.model_validate(fields)


@router.post("/v2/sandboxes", status_code=201)
@router.post("/sandboxes", status_code=201, include_in_schema=False)
async def create_sandbox(
    body: E2BNewSandbox,
    tenant: Tenant,
    ctx: Context,
    idempotency_key: IdempotencyKey = None,
) -> dict[str, Any]:
    """A new sandbox; idempotent with the SDK's ``idempotency_key``."""
    create = _create_body(body, ctx.settings.default_timeout_s)
    asked = body.model_dump(mode="json", exclude_unset=True)
    idem = idempotency(idempotency_key, tenant, "e2b-create", None, asked)
    record = await lifecycle.create_sandbox(ctx, tenant, create, timeout_given=True, idem=idem)
    return created_sandbox(ctx, record)


def _metadata_filter(text: str | None) -> dict[str, str]:
    """E2B's ``metadata`` query: ``k=v&k2=v2`` with each key and value quoted once
    more (the SDK quotes them, then url-encodes the pairs)."""
    if not text:
        return {}
    pairs = urllib.parse.parse_qsl(text, keep_blank_values=True, max_num_fields=64)
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def _matches(
    record: SandboxRecord,
    states: set[str],
    metadata: dict[str, str],
    template: str | None,
    started_after: float | None,
) -> bool:
    state = e2b_state(record)
    if state is None or (states and state not in states):
        return False
    if any(record.metadata.get(k) != v for k, v in metadata.items()):
        return False
    if template is not None and template not in (record.template, _name(record.template)):
        return False
    return started_after is None or record.created_at >= started_after


def _name(ref: str) -> str:
    return parse_ref(ref).name


def _token(record: SandboxRecord) -> str:
    return base64.urlsafe_b64encode(f"{record.created_at!r} {record.id}".encode()).decode()


def _after_token(token: str) -> tuple[float, str]:
    try:
        stamp, _, sandbox_id = base64.urlsafe_b64decode(token.encode()).decode().partition(" ")
        return float(stamp), sandbox_id
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise E2BError(400, "nextToken is not a token this API gave") from None


def _beyond(key: tuple[float, str], cursor: tuple[float, str], descending: bool) -> bool:
    return key < cursor if descending else key > cursor


@router.get("/v2/sandboxes")
async def list_sandboxes(
    tenant: Tenant,
    ctx: Context,
    metadata: Annotated[str | None, Query(max_length=8192)] = None,
    state: Annotated[str | None, Query(max_length=64)] = None,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "asc",
    startedAfter: Annotated[datetime | None, Query()] = None,
    template: Annotated[str | None, Query(max_length=129)] = None,
    nextToken: Annotated[str | None, Query(max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
) -> Response:
    """A page of the tenant's sandboxes by start time; ``x-next-token`` names the next."""
    states = set(filter(None, (state or "").split(",")))
    if states - {"running", "paused"}:
        raise E2BError(400, f"state must be running and/or paused, not {state!r}")
    after = None if startedAfter is None else startedAfter.timestamp()
    wanted = _metadata_filter(metadata)
    records = await ctx.db.run(lambda s: repo.list_sandboxes(s, tenant))
    kept = [r for r in records if _matches(r, states, wanted, template, after)]
    kept.sort(key=lambda r: (r.created_at, r.id), reverse=order == "desc")
    if nextToken:
        cursor = _after_token(nextToken)
        kept = [r for r in kept if _beyond((r.created_at, r.id), cursor, order == "desc")]
    page = kept[:limit]
    headers = {"x-next-token": _token(page[-1])} if len(kept) > limit else None
    shown = [listed_sandbox(ctx.activity.latest(r)) for r in page]
    return JSONResponse(shown, headers=headers)


@router.get("/sandboxes")
async def list_running_sandboxes(
    tenant: Tenant, ctx: Context, metadata: Annotated[str | None, Query(max_length=8192)] = None
) -> list[dict[str, Any]]:
    """E2B's first list: the running sandboxes, all at once."""
    wanted = _metadata_filter(metadata)
    records = await ctx.db.run(lambda s: repo.list_sandboxes(s, tenant))
    running = [r for r in records if _matches(r, {"running"}, wanted, None, None)]
    return [listed_sandbox(ctx.activity.latest(r)) for r in running]


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(sandbox: E2BSandbox, ctx: Context) -> dict[str, Any]:
    return sandbox_detail(ctx, sandbox)


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill_sandbox(sandbox_id: str, tenant: Tenant, ctx: Context) -> Response:
    """Delete the sandbox, whatever its state (one E2B does not show, too: an error
    sandbox is killed as any); 404 once deleted."""
    record = await ctx.db.run(lambda s: repo.find_sandbox(s, tenant, sandbox_id))
    if record is None:
        raise E2BError(404, f"sandbox {sandbox_id!r} not found")
    await lifecycle.delete_sandbox(ctx, record)
    return Response(status_code=204)


async def set_timeout_of(ctx: ControlContext, record: SandboxRecord, timeout_s: int) -> None:
    """Make ``record``'s E2B timeout end ``timeout_s`` seconds from now: its idle
    timeout if it auto-pauses, else its lifetime (space.control.e2b._shapes)."""
    if auto_pauses(record):
        await lifecycle.set_timeouts(ctx, record, {"idle_timeout_s": timeout_s})
    else:
        lifetime = lifetime_for(record, timeout_s, ctx.clock())
        await lifecycle.set_timeouts(ctx, record, {"max_lifetime_s": lifetime})


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(body: E2BTimeout, sandbox: E2BSandbox, ctx: Context) -> Response:
    """The sandbox ends ``timeout`` seconds from now (shorter or longer than before)."""
    await set_timeout_of(ctx, sandbox, body.timeout)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause_sandbox(
    sandbox: E2BSandbox, ctx: Context, body: E2BPause | None = None
) -> Response:
    """SPACE's pause (vCPUs stopped, memory kept); 409 if already paused."""
    if body is not None and not body.memory:
        raise E2BError(400, "memory: false (filesystem-only pause) is not supported by SPACE")
    if e2b_state(sandbox) == "paused":
        raise E2BError(409, f"sandbox {sandbox.id} is already paused")
    await lifecycle.pause_sandbox(ctx, sandbox)
    return Response(status_code=204)


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(body: E2BNetworkUpdate, sandbox: E2BSandbox, ctx: Context) -> Response:
    """Replace the sandbox's egress policy (space.control.e2b._network), as ``PUT
    /v1/sandboxes/{id}/egress`` does."""
    policy = egress_policy(body.allow_internet_access, body.as_network())
    await egress.set_policy(ctx, sandbox, policy)
    return Response(status_code=204)


async def _wake(ctx: ControlContext, record: SandboxRecord, memory: bool) -> SandboxRecord:
    if not memory:
        raise E2BError(400, "memory: false (resume by cold boot) is not supported by SPACE")
    if e2b_state(record) == "paused":
        record = await lifecycle.resume_sandbox(ctx, record)
    return record


async def _extend(ctx: ControlContext, record: SandboxRecord, timeout_s: int) -> None:
    """Make the timeout end no sooner than ``timeout_s`` seconds from now."""
    if end_at(record) < ctx.clock() + timeout_s:
        await set_timeout_of(ctx, record, timeout_s)


@router.post("/v2/sandboxes/{sandbox_id}/connect")
@router.post("/sandboxes/{sandbox_id}/connect", include_in_schema=False)
async def connect_sandbox(
    sandbox: E2BSandbox, ctx: Context, body: E2BConnect | None = None
) -> JSONResponse:
    """Resume a paused sandbox (201; 200 if it was running) and extend its timeout."""
    body = body or E2BConnect.model_validate({})
    was_paused = e2b_state(sandbox) == "paused"
    record = await _wake(ctx, sandbox, body.memory)
    await _extend(ctx, record, body.timeout)
    return JSONResponse(created_sandbox(ctx, record), status_code=201 if was_paused else 200)


@router.post("/sandboxes/{sandbox_id}/resume", status_code=201)
async def resume_sandbox(
    sandbox: E2BSandbox, ctx: Context, body: E2BResume | None = None
) -> dict[str, Any]:
    """E2B's older resume: 409 for a running sandbox."""
    body = body or E2BResume.model_validate({})
    if e2b_state(sandbox) != "paused":
        raise E2BError(409, f"sandbox {sandbox.id} is already running")
    if body.autoPause is not None and body.autoPause != auto_pauses(sandbox):
        raise E2BError(400, "autoPause cannot be changed on resume by SPACE")
    record = await _wake(ctx, sandbox, body.memory)
    await set_timeout_of(ctx, record, body.timeout)
    return created_sandbox(ctx, record)
