"""``Idempotency-Key`` on creates and forks (issue 19): a retried request makes nothing new.

A create or fork that carries the header is fingerprinted (SHA-256 of its operation, its
target and its body as validated, so key order and spacing do not matter). Then:

- a live key of the tenant with the same fingerprint answers what that request made,
  the same sandboxes in the same shape and status code, as they are now (one still
  ``creating`` is waited for, up to ``REPLAY_WAIT_S``);
- a live key with another fingerprint is 422 ``invalid_argument``: a key names one
  request;
- otherwise the key's row is inserted in the transaction that inserts the new
  sandboxes' rows (space.control.quota_checks), so two requests racing with one key,
  through one replica or two, make one set of sandboxes: the loser's insert fails on
  the key and it answers the winner's sandboxes.

A request that made nothing in the end (the node refused it, no node had room, a fork
failed) gives its key back, so that a retry tries again; one whose sandbox is in
``error`` keeps it (a retry answers that sandbox). Keys are remembered for
``IDEMPOTENCY_KEY_TTL_S`` and swept by the reaper.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.store import idempotency as store
from space.control.store import repo
from space.control.store.idempotency import IdempotencyRecord, KeyTaken
from space.control.store.repo import SandboxRecord
from space.limits import IDEMPOTENCY_KEY_CHARS, IDEMPOTENCY_KEY_TTL_S
from space.node.api import SandboxState

__all__ = ["HEADER", "REPLAY_WAIT_S", "Idempotency", "idempotency", "once", "sweep"]

HEADER = "Idempotency-Key"
#: How long a retry waits for the sandboxes of the first request to leave ``creating``
#: (a create from a cold template takes seconds under TCG) before answering them as
#: they are.
REPLAY_WAIT_S = 120.0
_POLL_S = 0.1
#: Rounds of "look, then claim" a request may lose to requests that gave the key back.
_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Idempotency:
    """A request's key and fingerprint, scoped to its tenant."""

    tenant_id: str
    key: str
    request_hash: str

    def record(self, sandbox_ids: list[str], now: float) -> IdempotencyRecord:
        expires_at = now + IDEMPOTENCY_KEY_TTL_S
        return IdempotencyRecord(
            self.tenant_id, self.key, self.request_hash, tuple(sandbox_ids), expires_at
        )


def idempotency(
    header: str | None, tenant: str, operation: str, target: str | None, body: dict[str, Any]
) -> Idempotency | None:
    """The request's Idempotency, None without the header.

    Raises ApiError(invalid_argument) for a key that is empty, longer than 255
    characters or not printable ASCII (nothing is done then).
    """
    if header is None:
        return None
    low, high = IDEMPOTENCY_KEY_CHARS
    if not low <= len(header) <= high or not all(" " <= c <= "~" for c in header):
        raise ApiError(
            "invalid_argument",
            f"{HEADER} must be {low} to {high} printable ASCII characters",
            field=HEADER,
            limit=high,
        )
    request = {"operation": operation, "target": target, "body": body}
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"))
    return Idempotency(tenant, header, hashlib.sha256(canonical.encode()).hexdigest())


async def once(
    ctx: ControlContext,
    idem: Idempotency | None,
    make: Callable[[Idempotency | None], Awaitable[list[SandboxRecord]]],
) -> list[SandboxRecord]:
    """``make``'s sandboxes, or with a key those its first request made.

    ``make`` must claim the key it is given with the rows of its sandboxes
    (``quota_checks.insert_sandboxes``). Raises what ``make`` raises (its key then
    given back if none of its sandboxes lives), ApiError(invalid_argument) for a key
    used with another request, ApiError(conflict) if the key kept being taken and given
    back.
    """
    if idem is None:
        return await make(None)
    for _ in range(_ATTEMPTS):
        made = await _replay(ctx, idem)
        if made is not None:
            return made
        try:
            return await make(idem)
        except KeyTaken:
            continue  # another request claimed it meanwhile: answer what it made
        except Exception:
            await ctx.db.run(lambda s: _release_unless_made(s, idem, ctx.clock()))
            raise
    raise ApiError(
        "conflict",
        f"requests with this {HEADER} keep failing concurrently: retry",
        field=HEADER,
    )


async def _replay(ctx: ControlContext, idem: Idempotency) -> list[SandboxRecord] | None:
    """What the key's first request made, once none is ``creating`` (or REPLAY_WAIT_S
    passed); None if the key is not held."""
    deadline = time.monotonic() + REPLAY_WAIT_S
    while True:
        found = await ctx.db.run(lambda s: _made(s, idem, ctx.clock()))
        if found is None:
            return None
        creating = any(r.state == SandboxState.CREATING.value for r in found)
        if not creating or time.monotonic() >= deadline:
            return found
        await asyncio.sleep(_POLL_S)


def _made(session: Session, idem: Idempotency, now: float) -> list[SandboxRecord] | None:
    held = store.find(session, idem.tenant_id, idem.key, now)
    if held is None:
        return None
    if held.request_hash != idem.request_hash:
        raise ApiError(
            "invalid_argument",
            f"this {HEADER} was used with another request: a key names one request",
            field=HEADER,
        )
    found = [
        repo.find_sandbox(session, idem.tenant_id, sandbox_id, include_deleted=True)
        for sandbox_id in held.sandbox_ids
    ]
    made = [record for record in found if record is not None]
    # Rows forgotten (a refused create) whose key is not given back yet: nothing made.
    return made if len(made) == len(held.sandbox_ids) else None


def _release_unless_made(session: Session, idem: Idempotency, now: float) -> None:
    """Give the key back if it is this request's and none of its sandboxes lives."""
    held = store.find(session, idem.tenant_id, idem.key, now)
    if held is None or held.request_hash != idem.request_hash:
        return
    made = _made(session, idem, now) or []
    if all(record.state == repo.DELETED for record in made):
        store.release(session, held)


async def sweep(ctx: ControlContext) -> int:
    """Forget every expired key (a reaper round); returns how many."""
    now = ctx.clock()
    return await ctx.db.run(lambda s: store.sweep(s, now))
