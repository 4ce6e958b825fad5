"""Request context and FastAPI dependencies: the app context, the tenant, the sandbox."""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from space.control import quota_checks
from space.control.activity import Activity
from space.control.errors import ApiError
from space.control.instruments import PlatformMetrics
from space.control.keys import KeyVerdicts, tenant_for_key
from space.control.nodes import NodeRegistry
from space.control.quotas import TenantSlots
from space.control.settings import ControlSettings
from space.control.store import Database, repo
from space.control.store.repo import SandboxRecord
from space.node.api import SandboxState

__all__ = [
    "Context",
    "ControlContext",
    "LiveSandbox",
    "Sandbox",
    "Tenant",
    "authenticate",
    "live_sandbox",
    "load_or_create_node_token",
    "require_node_token",
]


@dataclass
class ControlContext:
    """What every request handler of one app shares (``app.state.ctx``)."""

    settings: ControlSettings
    db: Database
    nodes: NodeRegistry
    clock: Callable[[], float]
    node_token: str
    #: This replica's name in the job leases it holds (space.control.background).
    replica_id: str = field(default_factory=lambda: f"replica-{secrets.token_hex(8)}")
    #: The job leases it holds, and until when (space.control.background).
    held_jobs: dict[str, float] = field(init=False, default_factory=dict)
    activity: Activity = field(init=False)
    #: API keys this replica found valid recently (space.control.keys).
    key_verdicts: KeyVerdicts = field(init=False)
    #: Per tenant: builds in flight, and the lock that wakes, hibernations and creates
    #: take (space.control.quotas).
    slots: TenantSlots = field(init=False, default_factory=TenantSlots)
    #: Work this replica runs in the background of a request (template shipping after
    #: a build, space.control.shipping), cancelled when the app stops.
    tasks: set[asyncio.Task[None]] = field(init=False, default_factory=set)
    #: This replica's Prometheus histograms (space.control.prometheus serves them).
    metrics: PlatformMetrics = field(init=False, default_factory=PlatformMetrics)

    def __post_init__(self) -> None:
        self.activity = Activity(self.db, self.clock)
        self.key_verdicts = KeyVerdicts(self.clock)


def load_or_create_node_token(path: Path) -> str:
    """The node token in ``path``, made (0600, 32 random bytes) if the file is missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = path.read_text().strip()
        if not token:
            raise ApiError("internal", f"node token file {path} is empty") from None
        return token
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as file:
        file.write(token + "\n")
    return token


async def _context(request: Request) -> ControlContext:
    # async: FastAPI runs a plain function dependency in a worker thread, a hop (and a
    # wait for the GIL) on every request for an attribute read.
    ctx: ControlContext = request.app.state.ctx
    return ctx


Context = Annotated[ControlContext, Depends(_context)]


def _presented_key(headers: Mapping[str, str]) -> str | None:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key") or None


async def authenticate(ctx: ControlContext, headers: Mapping[str, str]) -> str:
    """The tenant of the API key in ``headers`` (Authorization: Bearer, or X-API-Key).

    The verdict of this replica is kept VERDICT_TTL_S (space.control.keys). Raises
    ApiError(unauthenticated) for a missing, unknown or revoked key (within
    VERDICT_TTL_S of its revoke: it may still pass).
    """
    key = _presented_key(headers)
    if key is None:
        raise ApiError(
            "unauthenticated", "missing API key: send Authorization: Bearer <key> or X-API-Key"
        )
    tenant = ctx.key_verdicts.tenant(key)
    if tenant is not None:
        return tenant
    tenant = await ctx.db.read(lambda session: tenant_for_key(session, key))
    if tenant is None:
        raise ApiError("unauthenticated", "unknown or revoked API key")
    ctx.key_verdicts.remember(key, tenant)
    return tenant


async def _tenant(request: Request, ctx: Context) -> str:
    # The edge (space.control.edges) authenticated the request before its body was read.
    tenant = getattr(request.state, "tenant", None)
    if isinstance(tenant, str):
        return tenant
    return await authenticate(ctx, request.headers)


Tenant = Annotated[str, Depends(_tenant)]


async def _sandbox(sandbox_id: str, tenant: Tenant, ctx: Context) -> SandboxRecord:
    # The tenant is part of the query: another tenant's id is exactly a missing id.
    record = await ctx.db.read(lambda s: repo.find_sandbox(s, tenant, sandbox_id))
    if record is None:
        raise ApiError("not_found", f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
    return record


Sandbox = Annotated[SandboxRecord, Depends(_sandbox)]


#: States a guest operation resumes from.
_RESUMABLE = frozenset({SandboxState.PAUSED.value, SandboxState.HIBERNATED.value})


async def live_sandbox(ctx: ControlContext, record: SandboxRecord) -> SandboxRecord:
    """``record`` running: resumed first if paused or hibernated (within its tenant's
    quotas), and marked active. Raises ApiError(conflict) in any other state, and what
    resuming raises. Also for requests that reach a sandbox without the API (envd's
    translation, space.control.e2b, and space.control.ports)."""
    if record.state in _RESUMABLE:
        # Guest operations resume a paused or hibernated sandbox transparently (the node
        # would too); resuming here first keeps the row's state true, and a wake within
        # the tenant's quotas.
        async with quota_checks.waking(ctx, record, "resume"):
            status = await ctx.nodes.get(record.node_id).resume_sandbox(record.id)
            state = status.state.value
            await ctx.db.run(lambda s: repo.set_state(s, record.id, state, error=status.error))
        record = replace(record, state=state, error=status.error)
    if record.state != repo.RUNNING:
        raise ApiError(
            "conflict",
            f"sandbox {record.id} is {record.state}, not running",
            sandbox_id=record.id,
            state=record.state,
        )
    marked = ctx.activity.mark(record.id, record.last_active_at)
    return record if marked is None else replace(record, last_active_at=marked)


async def _live_sandbox(record: Sandbox, ctx: Context) -> SandboxRecord:
    return await live_sandbox(ctx, record)


#: A sandbox of the caller's tenant that is running, resumed first if it was paused or
#: hibernated (409 in any other state), and marked active.
LiveSandbox = Annotated[SandboxRecord, Depends(_live_sandbox)]


async def require_node_token(request: Request, ctx: Context) -> None:
    """Dependency: the request presents the node token as a bearer token (401 otherwise)."""
    expected = f"Bearer {ctx.node_token}".encode()
    given = request.headers.get("authorization", "").encode()
    if not hmac.compare_digest(given, expected):
        raise ApiError("unauthenticated", "missing or wrong node token")
