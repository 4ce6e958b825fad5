"""The credential broker (issue 5): tenants' secrets, sandboxes' bindings, grants pushed.

A tenant stores a secret once (``put_secret``, sealed by space.control.secrets); a
sandbox created with ``secrets: [NAME]`` is bound to it: its row records a placeholder
(``space_ph_`` + 32 random hex digits) that its environment holds as the secret's
``env``, and its node gets a SecretGrant (the value, decrypted here, in memory) that
lets its egress gateway put the value in place of the placeholder on requests to the
secret's hosts. The guest never sees the value; no response, error or log line holds it.

Grants are the node's memory only, so the control plane sends a sandbox's grants
again whenever they may differ from what its node holds: after its creation or fork,
when a bound secret is replaced or deleted, and when its node's boot id changed
(``sync_restarted_nodes``, each reaper round and at startup). A push that fails for a
transient reason makes the node's boot id forgotten, so the next round pushes again.
Pushes to one sandbox are serialized in this replica and read the grants inside the
lock, so the last push carries the latest secrets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets as random
import weakref
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import replace
from typing import Literal, TypeVar

from sqlalchemy.orm import Session

from space.control.deps import ControlContext
from space.control.errors import ApiError
from space.control.schemas import SecretPut
from space.control.secrets import Keyring, SecretStoreError, load_keyring, open_record
from space.control.store import nodes as node_rows
from space.control.store import repo
from space.control.store import secrets as stored
from space.control.store.repo import SandboxRecord, SecretBinding
from space.control.store.secrets import SecretRecord
from space.node.api import (
    InvalidArgument,
    NodeError,
    SecretGrant,
    check_grants,
    check_header_name,
    check_host_patterns,
    check_secret_name,
    check_secret_value,
)

__all__ = [
    "PLACEHOLDER_PREFIX",
    "bind",
    "delete_secret",
    "new_placeholder",
    "placeholder_env",
    "push",
    "push_to_children",
    "put_secret",
    "sync_restarted_nodes",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

PLACEHOLDER_PREFIX = "space_ph_"
#: How long a reaper round waits for a node's boot id (a silent node must not stall it).
INFO_TIMEOUT_S = 10.0
#: Node error codes worth another try at the next reaper round.
_TRANSIENT = frozenset({"unavailable", "timeout"})
#: States whose sandbox has a VM or its saved state, and so a gateway holding grants.
_GRANTED = frozenset({"running", "paused", "hibernated"})
_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()


def new_placeholder() -> str:
    """A fresh placeholder: not secret, but unguessable so it never collides."""
    return PLACEHOLDER_PREFIX + random.token_hex(16)


def placeholder_env(bindings: Collection[SecretBinding]) -> dict[str, str]:
    """The environment variables a sandbox's bindings put in its spec."""
    return {binding.env: binding.placeholder for binding in bindings}


async def _in_thread(ctx: ControlContext, fn: Callable[[Session, Keyring], T]) -> T:
    """Run ``fn`` with the keyring (loaded from ctx.settings) in one DB transaction.

    The keyring is read per call (a small file) so no key material is cached here;
    its errors become ApiError(internal), naming the secret but never a value.
    """

    def call(session: Session) -> T:
        return fn(session, load_keyring(ctx.settings))

    try:
        return await ctx.db.run(call)
    except SecretStoreError as exc:
        raise ApiError("internal", f"secret store: {exc}") from None


# -- tenants' secrets ----------------------------------------------------------------


def _check(field: str, check: Callable[..., T], *args: object) -> T:
    """``check(*args)``; its InvalidArgument as ApiError(invalid_argument) naming ``field``."""
    try:
        return check(*args)
    except InvalidArgument as exc:
        raise ApiError("invalid_argument", exc.message, field=field) from None


def _checked(tenant: str, name: str, body: SecretPut, now: float) -> SecretRecord:
    """The record ``body`` describes, not yet sealed; ApiError(invalid_argument) naming
    the field wherever the node would refuse the grant (never quoting the value)."""
    _check("name", check_secret_name, name)
    _check("value", check_secret_value, body.value)
    hosts = _check("hosts", check_host_patterns, body.hosts)
    if body.env is not None:
        _check("env", check_secret_name, body.env, "env")
    if body.header is not None:
        _check("header", check_header_name, body.header)
    if body.injection == "placeholder" and (body.header is not None or body.format != "{value}"):
        message = "header and format are for injection 'header'"
        raise ApiError("invalid_argument", message, field="injection")
    trial = SecretGrant(name, body.value, new_placeholder(), hosts, body.env, body.injection,
                        body.header, body.format)  # fmt: skip
    _check("format", check_grants, [trial])
    unsealed = stored.Sealed("", b"", b"", b"")  # sealed in the transaction, with the keyring
    return SecretRecord(tenant, name, hosts, body.env or name, body.injection, body.header,
                        body.format, unsealed, now, now)  # fmt: skip


async def put_secret(ctx: ControlContext, tenant: str, name: str, body: SecretPut) -> SecretRecord:
    """Create or replace the tenant's secret ``name``; returns its stored metadata.

    Idempotent. ApiError(invalid_argument) names the bad field (nothing changes). The
    row is written first; then every running, paused or hibernated sandbox bound to
    ``name`` gets its grants again (a node failing that is logged and retried by the
    reaper: the answer is still the stored secret).
    """
    record = _checked(tenant, name, body, ctx.clock())

    def store(session: Session, keyring: Keyring) -> SecretRecord:
        sealed = keyring.seal(tenant, name, body.value)
        return stored.upsert_secret(session, replace(record, sealed=sealed))

    saved = await _in_thread(ctx, store)
    await _push_bound(ctx, tenant, name)
    return saved


async def delete_secret(ctx: ControlContext, tenant: str, name: str) -> None:
    """Delete the tenant's secret (idempotent) and take it out of the grants of every
    sandbox bound to it; their bindings stay (a new secret of that name is used again)."""
    if await ctx.db.run(lambda s: stored.delete_secret(s, tenant, name)):
        await _push_bound(ctx, tenant, name)


# -- sandboxes' bindings -------------------------------------------------------------


async def bind(
    ctx: ControlContext,
    tenant: str,
    names: list[str] | None,
    inherited: tuple[SecretBinding, ...],
    env: Collection[str],
) -> tuple[SecretBinding, ...]:
    """The bindings of a new sandbox: ``names`` (None: ``inherited`` as they are).

    A name ``inherited`` has keeps its placeholder there (a sandbox from a snapshot
    holds it in memory already); others get fresh ones. Raises ApiError(invalid_argument)
    for a name given twice, one the tenant has no secret of (naming it), or a variable
    set twice (by two secrets, or by a secret and ``env``).
    """
    if names is None:
        _check_variables(inherited, env)
        return inherited
    if len(set(names)) != len(names):
        raise ApiError("invalid_argument", "secrets: a name is given twice", field="secrets")
    # Most creates bind no secret: no transaction for an empty list (issue 21).
    found = await ctx.db.run(lambda s: stored.find_secrets(s, tenant, names)) if names else {}
    unknown = [name for name in names if name not in found]
    if unknown:
        raise ApiError(
            "invalid_argument",
            f"secrets: no secret {unknown[0]!r}",
            field="secrets",
            name=unknown[0],
        )
    old = {binding.name: binding for binding in inherited}
    bindings = tuple(
        SecretBinding(name, old[name].placeholder if name in old else new_placeholder(),
                      found[name].env)
        for name in names
    )  # fmt: skip
    _check_variables(bindings, env)
    return bindings


def _check_variables(bindings: tuple[SecretBinding, ...], env: Collection[str]) -> None:
    seen = set(env)
    for binding in bindings:
        if binding.env in seen:
            message = f"secrets: {binding.name!r} sets {binding.env}, which is set already"
            raise ApiError("invalid_argument", message, field="secrets", name=binding.name)
        seen.add(binding.env)


def _grants(session: Session, keyring: Keyring, record: SandboxRecord) -> list[SecretGrant]:
    """``record``'s grants: its bindings whose secret exists, values decrypted."""
    found = stored.find_secrets(session, record.tenant_id, [b.name for b in record.secrets])
    grants = []
    for binding in record.secrets:
        secret = found.get(binding.name)
        if secret is not None:
            grants.append(
                SecretGrant(binding.name, open_record(keyring, secret), binding.placeholder,
                            secret.hosts, binding.env, _injection(secret.injection),
                            secret.header, secret.format)
            )  # fmt: skip
    return grants


def _injection(text: str) -> Literal["placeholder", "header"]:
    return "header" if text == "header" else "placeholder"


@contextlib.asynccontextmanager
async def _pushing(sandbox_id: str) -> AsyncIterator[None]:
    lock = _locks.get(sandbox_id)
    if lock is None:
        lock = _locks[sandbox_id] = asyncio.Lock()
    async with lock:
        yield


async def push(ctx: ControlContext, record: SandboxRecord) -> None:
    """Send ``record``'s grants, as the database has them now, to its node.

    Raises the node's NodeError, ApiError(unavailable) for an unregistered node, or
    ApiError(internal) for a secret that does not decrypt (naming it).
    """
    async with _pushing(record.id):
        grants = await _in_thread(ctx, lambda s, keyring: _grants(s, keyring, record))
        await ctx.nodes.get(record.node_id).set_secrets(record.id, grants)


async def _push_logged(ctx: ControlContext, record: SandboxRecord) -> bool:
    """``push``; a failure is logged. False if worth retrying (the node's boot id is then
    forgotten, so the reaper's next round pushes its sandboxes again)."""
    try:
        await push(ctx, record)
    except (NodeError, ApiError) as exc:
        log.warning("could not send the secrets of sandbox %s: %s", record.id, exc)
        if exc.code in _TRANSIENT:
            await ctx.db.run(lambda s: node_rows.set_node_boot_id(s, record.node_id, None))
            return False
    return True


async def _push_bound(ctx: ControlContext, tenant: str, name: str) -> None:
    for record in await ctx.db.run(lambda s: repo.bound_to(s, tenant, name)):
        await _push_logged(ctx, record)


async def push_to_children(ctx: ControlContext, children: list[SandboxRecord]) -> None:
    """Send each fork child's grants (its parent's bindings, in its row); whether a
    node's fork copies them is not NodeService's contract. Failures are logged."""
    for child in children:
        if child.secrets:
            await _push_logged(ctx, child)


async def sync_restarted_nodes(ctx: ControlContext) -> None:
    """Send every sandbox's grants to each node whose boot id is not the one they were
    last all sent to; then remember that boot id. Only nodes running sandboxes bound to
    secrets are asked (within INFO_TIMEOUT_S); one that does not answer is skipped
    (logged), one whose push failed transiently is tried again next call."""
    for node_id in ctx.nodes.ids():
        granted = await _granted_on(ctx, node_id)
        if not granted:
            continue
        try:
            async with asyncio.timeout(INFO_TIMEOUT_S):
                boot_id = (await ctx.nodes.get(node_id).info()).boot_id
        except (NodeError, ApiError, TimeoutError) as exc:
            log.warning("could not ask node %s for its boot id: %r", node_id, exc)
            continue
        await _sync_node(ctx, node_id, boot_id, granted)


async def _granted_on(ctx: ControlContext, node_id: str) -> list[SandboxRecord]:
    """The node's sandboxes that have a gateway and secret bindings."""
    records = await ctx.db.read(lambda s: repo.on_node(s, node_id))
    return [record for record in records if record.secrets and record.state in _GRANTED]


async def _sync_node(
    ctx: ControlContext, node_id: str, boot_id: str, records: list[SandboxRecord]
) -> None:
    if boot_id == await ctx.db.run(lambda s: node_rows.node_boot_id(s, node_id)):
        return
    complete = True
    for record in records:
        complete = await _push_logged(ctx, record) and complete
    if complete:
        await ctx.db.run(lambda s: node_rows.set_node_boot_id(s, node_id, boot_id))
