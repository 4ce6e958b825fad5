"""``AsyncSandbox``, the async core of the SDK, and ``AsyncSandboxes``, the calls that
make or list sandboxes (``AsyncSpace.sandboxes``; ``AsyncSandbox.create`` and its
sibling classmethods run them on a connection of their own). The sync ``Sandbox`` wraps
both."""

from __future__ import annotations

import builtins
import enum
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, Final, Literal

import httpx

from space.limits import ENV, MAX_FORK_CHILDREN, METADATA
from space.sdk._commands import AsyncCommands
from space.sdk._files import AsyncFiles
from space.sdk._http import ApiClient, json_object, listed, one_call, same_contract
from space.sdk._metrics import SandboxMetric, get_metrics
from space.sdk._models import PoolInfo, SandboxInfo, SnapshotInfo
from space.sdk._network import AsyncNetwork
from space.sdk._sandbox_requests import (
    bounded_map,
    create_body,
    idempotency_header,
    ports_body,
    secret_names,
    segment,
    snapshot_id,
)
from space.sdk.errors import InvalidArgument, NotFound

__all__ = ["KEEP", "AsyncSandbox", "AsyncSandboxes"]

#: A create may boot a VM cold (seconds under TCG) or wait for a template: allow longer.
CREATE_TIMEOUT_S = 180.0
#: Hibernate, resume, snapshot, restore and fork save or load guest memory (seconds under
#: TCG for a few hundred MiB): they get the create's allowance, not a plain request's.
LIFECYCLE_TIMEOUT_S = CREATE_TIMEOUT_S


class _Keep(enum.Enum):
    """The default of ``set_timeouts``' arguments: leave that timeout as it is."""

    KEEP = "keep"

    def __repr__(self) -> str:
        return "KEEP"


#: ``set_timeouts(idle_timeout_s=KEEP)``: unchanged (the default); None means no timeout.
KEEP: Final = _Keep.KEEP


class AsyncSandboxes:
    """``space.sandboxes`` of an ``AsyncSpace``: create, find and list sandboxes, list
    and delete snapshots, list warm pools, over that client's one connection.

    Sandboxes made here share it: their ``close()`` leaves it open, and closing the
    ``AsyncSpace`` closes theirs. (``AsyncSandbox.create`` and its siblings run the same
    calls on a connection of their own, which the sandbox made keeps.)
    """

    def __init__(self, api: ApiClient, *, hand_over: bool = False) -> None:
        self._api = api
        # hand_over: the sandbox made is the only user of ``api`` and closes it.
        self._hand_over = hand_over

    async def create(
        self,
        template: str | None = None,
        *,
        cpus: int | None = None,
        memory_mib: int | None = None,
        disk_mib: int | None = None,
        timeout_s: int | None = 300,
        idle_timeout_s: int | None = None,
        from_snapshot: SnapshotInfo | str | None = None,
        env: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        egress: Mapping[str, Any] | None = None,
        secrets: Sequence[str] | None = None,
        idempotency_key: str | None = None,
        expose_ports: bool | Literal["public"] | None = None,
    ) -> AsyncSandbox:
        """Create a sandbox and return once it runs.

        ``template``, ``cpus``, ``memory_mib`` and ``disk_mib`` left as None take the
        API's defaults (``base``, 1, 256 MiB, 2048 MiB). ``from_snapshot`` starts it from
        a snapshot instead (its disk, memory and running processes, with a fresh guest
        identity); the four then come from the snapshot and must stay None.
        ``timeout_s`` is its maximum lifetime from creation, ``idle_timeout_s`` how long
        it may go without activity (commands, file calls) before it hibernates (seconds;
        None: no limit). ``egress`` is its network policy (``allow(...)`` writes one;
        see ``sandbox.network``); None gives no network, or with ``from_snapshot`` the
        policy of the snapshot's sandbox. ``secrets`` names the tenant's secrets (see
        ``Secrets``) it may use: its environment holds a placeholder for each, which its
        egress gateway swaps for the value on requests to the secret's hosts; None gives
        none, or with ``from_snapshot`` those of the snapshot's sandbox.
        ``expose_ports`` lets servers listening in it be reached through the platform
        (``get_host``): True for holders of its ``traffic_token``, ``"public"`` for
        anyone; None or False: nobody (None with ``from_snapshot``: as the snapshot's
        sandbox). ``set_ports`` changes it later.

        Raises InvalidArgument (limits in docs/api.md, a size given with
        ``from_snapshot``, a ``secrets`` that is a string: nothing is sent then; an
        unknown secret, named by the server), NotFound (template or snapshot),
        InsufficientCapacity (no node has room now: nothing was created; its
        ``retry_after_s`` says when to try again), AuthenticationError, Unavailable,
        Timeout (after 180 s). Idempotent with ``idempotency_key`` (1 to 255 printable
        ASCII characters, kept 24 h by the server): a retry with the same key and
        arguments returns the sandbox the first call made, as it is now, and never makes
        a second; the same key with other arguments raises InvalidArgument. Without a
        key, a cancellation mid-way may leave a sandbox behind that ``list()`` shows,
        and a retry makes another.
        """
        body = create_body(template, cpus, memory_mib, disk_mib, from_snapshot)
        body.update(
            timeout_s=timeout_s,
            env=bounded_map(ENV, "env", env, "sandbox.create"),
            metadata=bounded_map(METADATA, "metadata", metadata, "sandbox.create"),
        )
        if idle_timeout_s is not None:
            body["idle_timeout_s"] = idle_timeout_s
        if egress is not None:
            body["egress"] = dict(egress)
        if secrets is not None:
            body["secrets"] = secret_names(secrets)
        if expose_ports is not None:
            body["ports"] = ports_body(expose_ports, "sandbox.create")
        answer = await self._api.request_json(
            "POST",
            "/v1/sandboxes",
            operation="sandbox.create",
            json_body=body,
            timeout_s=CREATE_TIMEOUT_S,
            headers=idempotency_header(idempotency_key, "sandbox.create"),
        )
        return self._sandbox(SandboxInfo.from_wire(json_object(answer)))

    async def connect(self, sandbox_id: str) -> AsyncSandbox:
        """Attach to an existing sandbox. Raises NotFound if it does not exist. Read-only."""
        return self._sandbox(await _get_info(self._api, sandbox_id))

    async def list(self) -> builtins.list[SandboxInfo]:
        """Every sandbox of the key's tenant. Read-only."""
        body = await self._api.request_json("GET", "/v1/sandboxes", operation="sandbox.list")
        sandboxes = listed(body, "sandboxes", operation="sandbox.list")
        return [SandboxInfo.from_wire(json_object(s)) for s in sandboxes]

    async def list_snapshots(self, *, sandbox_id: str | None = None) -> builtins.list[SnapshotInfo]:
        """Every snapshot of the key's tenant, or only those taken of ``sandbox_id``.

        The snapshots form a forest by ``parent_id`` (a parent may be missing from a
        per-sandbox listing). Raises NotFound for an unknown ``sandbox_id``. Read-only.
        """
        path = "/v1/snapshots"
        if sandbox_id is not None:
            path = f"/v1/sandboxes/{segment(sandbox_id, 'sandbox id')}/snapshots"
        return await _get_snapshots(self._api, path, sandbox_id)

    async def list_pools(self) -> builtins.list[PoolInfo]:
        """The warm pools of ``base`` and the tenant's own templates on every node, by
        node id then template (in the tenant's names).

        A node that does not answer is left out rather than failing the call. Raises
        AuthenticationError for a missing or unknown key. Read-only.
        """
        body = await self._api.request_json("GET", "/v1/pools", operation="pool.list")
        return [PoolInfo.from_wire(json_object(p)) for p in listed(body, "pools", "pool.list")]

    async def delete_snapshot(self, snapshot: SnapshotInfo | str) -> None:
        """Delete a snapshot; its children in the tree are re-parented to its parent.

        Idempotent: deleting a snapshot that is already gone succeeds. Sandboxes made or
        restored from it are unaffected. Raises InvalidArgument for a malformed id
        (nothing is sent).
        """
        path = f"/v1/snapshots/{snapshot_id(snapshot)}"
        await self._api.request_json("DELETE", path, operation="snapshot.delete")

    def _sandbox(self, info: SandboxInfo) -> AsyncSandbox:
        return AsyncSandbox(info, self._api, owns_api=self._hand_over)


class AsyncSandbox:
    """A sandbox (one VM) and a connection to the API that manages it.

    Make one with ``await AsyncSandbox.create()`` or ``await AsyncSandbox.connect(id)``
    (or through an ``AsyncSpace``, sharing its connection: ``space.sandboxes.create()``).
    ``async with`` kills the sandbox on exit; ``close()`` only drops the connection and
    leaves the sandbox running. The API URL and key come from the arguments, else from
    SPACE_API_URL / SPACE_API_KEY, else http://127.0.0.1:8080 and no key.
    """

    def __init__(self, info: SandboxInfo, api: ApiClient, *, owns_api: bool = True) -> None:
        self._info = info
        self._api = api
        # False for a sandbox of an AsyncSpace: the connection is the client's to close.
        self._owns_api = owns_api
        self.commands = AsyncCommands(api, info.sandbox_id)
        self.files = AsyncFiles(api, info.sandbox_id)
        self.network = AsyncNetwork(api, info.sandbox_id)

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.sandbox_id} template={self._info.template}>"

    @property
    def sandbox_id(self) -> str:
        return self._info.sandbox_id

    @classmethod
    @same_contract(AsyncSandboxes.create)
    async def create(
        cls,
        template: str | None = None,
        *,
        cpus: int | None = None,
        memory_mib: int | None = None,
        disk_mib: int | None = None,
        timeout_s: int | None = 300,
        idle_timeout_s: int | None = None,
        from_snapshot: SnapshotInfo | str | None = None,
        env: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        egress: Mapping[str, Any] | None = None,
        secrets: Sequence[str] | None = None,
        idempotency_key: str | None = None,
        expose_ports: bool | Literal["public"] | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> AsyncSandbox:
        async with one_call(api_url, api_key, request_timeout_s, _transport, keep_open=True) as api:
            return await AsyncSandboxes(api, hand_over=True).create(
                template, cpus=cpus, memory_mib=memory_mib, disk_mib=disk_mib,
                timeout_s=timeout_s, idle_timeout_s=idle_timeout_s, from_snapshot=from_snapshot,
                env=env, metadata=metadata, egress=egress, secrets=secrets,
                idempotency_key=idempotency_key, expose_ports=expose_ports,
            )  # fmt: skip

    @classmethod
    @same_contract(AsyncSandboxes.connect)
    async def connect(
        cls,
        sandbox_id: str,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> AsyncSandbox:
        async with one_call(api_url, api_key, request_timeout_s, _transport, keep_open=True) as api:
            return await AsyncSandboxes(api, hand_over=True).connect(sandbox_id)

    @classmethod
    @same_contract(AsyncSandboxes.list)
    async def list(
        cls,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> builtins.list[SandboxInfo]:
        async with one_call(api_url, api_key, request_timeout_s, _transport) as api:
            return await AsyncSandboxes(api).list()

    @classmethod
    @same_contract(AsyncSandboxes.list_snapshots)
    async def list_snapshots(
        cls,
        *,
        sandbox_id: str | None = None,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> builtins.list[SnapshotInfo]:
        async with one_call(api_url, api_key, request_timeout_s, _transport) as api:
            return await AsyncSandboxes(api).list_snapshots(sandbox_id=sandbox_id)

    @classmethod
    @same_contract(AsyncSandboxes.list_pools)
    async def list_pools(
        cls,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> builtins.list[PoolInfo]:
        async with one_call(api_url, api_key, request_timeout_s, _transport) as api:
            return await AsyncSandboxes(api).list_pools()

    @classmethod
    @same_contract(AsyncSandboxes.delete_snapshot)
    async def delete_snapshot(
        cls,
        snapshot: SnapshotInfo | str,
        *,
        api_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float | None = None,
        _transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        async with one_call(api_url, api_key, request_timeout_s, _transport) as api:
            await AsyncSandboxes(api).delete_snapshot(snapshot)

    async def get_info(self) -> SandboxInfo:
        """Fresh information about this sandbox (state, expiry...). NotFound once gone."""
        self._info = await _get_info(self._api, self.sandbox_id)
        return self._info

    async def get_metrics(
        self, *, start: datetime | float | None = None, end: datetime | float | None = None
    ) -> builtins.list[SandboxMetric]:
        """The sandbox's recent CPU, memory and disk samples, oldest first, those taken
        from ``start`` to ``end`` (datetimes or Unix seconds, both optional).

        A running sandbox is sampled now unless its last sample is younger than 5 s; a
        paused or hibernated one is not woken: it answers the samples its node kept
        (none after a node restart), any other state none. Does not count as activity.
        Raises NotFound once the sandbox is gone. Read-only.
        """
        return await get_metrics(self._api, self.sandbox_id, start, end)

    async def pause(self) -> SandboxInfo:
        """Pause the sandbox: its vCPUs stop, its memory and processes are kept.

        Idempotent (pausing a paused sandbox is fine). Any command or file call resumes
        it transparently; so does ``resume()``. The guest's clock stands still while
        paused. Raises Conflict (the message names the state) for a sandbox that is
        neither running nor paused, NotFound once it is gone.
        """
        return await self._transition("pause")

    async def resume(self) -> SandboxInfo:
        """Resume a paused sandbox (immediate) or wake a hibernated one (its memory is
        loaded back: seconds); idempotent. Raises as ``pause()``, and
        InsufficientCapacity if waking needs memory its node does not have now (it stays
        hibernated; so does a command or file call that would wake it).
        """
        return await self._transition("resume")

    async def hibernate(self) -> SandboxInfo:
        """Hibernate the sandbox: memory and device state go to its disk, the VM stops.

        A hibernated sandbox holds no RAM or CPU on its node. ``resume()``, or any
        command or file call, wakes it and its processes carry on. Idempotent. Raises
        Conflict (the message names the state) for a state that does not allow it,
        NotFound once the sandbox is gone. A cancellation mid-way may leave it running
        or hibernated; call again.
        """
        return await self._transition("hibernate")

    async def set_timeouts(
        self,
        *,
        idle_timeout_s: int | _Keep | None = KEEP,
        max_lifetime_s: int | _Keep | None = KEEP,
    ) -> SandboxInfo:
        """Change when the sandbox hibernates for idleness or is deleted for age.

        ``idle_timeout_s``: seconds without activity (commands, file calls) before it
        hibernates; ``max_lifetime_s``: seconds from its creation before it is deleted. None removes
        that limit; an argument left out (``KEEP``) stays as it is. Idempotent. Raises
        InvalidArgument (out of range), Conflict, NotFound.
        """
        body: dict[str, int | None] = {}
        if idle_timeout_s is not KEEP:
            body["idle_timeout_s"] = idle_timeout_s
        if max_lifetime_s is not KEEP:
            body["max_lifetime_s"] = max_lifetime_s
        answer = await self._api.request_json(
            "PUT",
            f"/v1/sandboxes/{self.sandbox_id}/timeouts",
            operation="sandbox.set_timeouts",
            sandbox_id=self.sandbox_id,
            json_body=body,
        )
        self._info = SandboxInfo.from_wire(json_object(answer))
        return self._info

    @property
    def traffic_token(self) -> str | None:
        """The token that opens its ports (``X-Space-Traffic-Token``); None unless they
        are exposed and not public. As of the last answer about this sandbox."""
        return self._info.ports.traffic_token

    def get_host(self, port: int) -> str:
        """The host name port ``port`` of this sandbox is reached at through the
        platform: ``<port>-<sandbox id>.<domain>`` (over HTTP(S) or WebSocket, with
        ``traffic_token`` unless the ports are public). Needs ports exposed to reach
        anything. Raises InvalidArgument for a port outside 1 to 65535, or when the
        platform has no sandbox domain (then send the headers ``E2b-Sandbox-Id`` and
        ``E2b-Sandbox-Port`` to the API's own address instead). Sends nothing.
        """
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidArgument(f"port must be 1 to 65535, got {port!r}", operation="get_host")
        domain = self._info.ports.domain
        if domain is None:
            raise InvalidArgument(
                "the platform has no sandbox domain (space serve --sandbox-domain)",
                operation="get_host",
                sandbox_id=self.sandbox_id,
            )
        return f"{port}-{self.sandbox_id}.{domain}"

    async def set_ports(self, expose: bool | Literal["public"]) -> SandboxInfo:
        """Who may reach servers listening in it: nobody (False), holders of its
        ``traffic_token`` (True), anyone (``"public"``); from the next request on.
        Idempotent. Raises NotFound once it is gone."""
        answer = await self._api.request_json(
            "PUT",
            f"/v1/sandboxes/{self.sandbox_id}/ports",
            operation="sandbox.set_ports",
            sandbox_id=self.sandbox_id,
            json_body=ports_body(expose, "sandbox.set_ports"),
        )
        self._info = SandboxInfo.from_wire(json_object(answer))
        return self._info

    async def snapshot(self, name: str) -> SnapshotInfo:
        """Snapshot the sandbox's disk and memory as ``name``; it keeps its state.

        Its parent in the snapshot tree is the sandbox's ``head_snapshot``. Not
        idempotent: Conflict if a snapshot named ``name`` exists, with
        ``details["snapshot_id"]`` naming it (which is also what a retry after a
        cancellation mid-way may meet). Raises Conflict for a state that does not allow
        it, NotFound, ResourceExhausted (quota or space).
        """
        answer = await self._api.request_json(
            "POST",
            f"/v1/sandboxes/{self.sandbox_id}/snapshots",
            operation="sandbox.snapshot",
            sandbox_id=self.sandbox_id,
            json_body={"name": name},
            timeout_s=LIFECYCLE_TIMEOUT_S,
        )
        return SnapshotInfo.from_wire(json_object(answer))

    async def snapshots(self) -> builtins.list[SnapshotInfo]:
        """The snapshots taken of this sandbox. NotFound once it is gone."""
        path = f"/v1/sandboxes/{self.sandbox_id}/snapshots"
        return await _get_snapshots(self._api, path, self.sandbox_id)

    async def restore(self, snapshot: SnapshotInfo | str) -> SandboxInfo:
        """Roll the sandbox back in place to ``snapshot``: disk, memory and processes.

        It is then running, with a fresh guest identity (hostname, machine-id, random
        seed, clock); what ran since is lost and open command streams end. Repeating it
        rolls back again. Raises NotFound (sandbox or snapshot), InvalidArgument (a
        snapshot of another template or size), Conflict (a state that does not allow
        it). A cancellation mid-way may leave it restored or not; call again.
        """
        answer = await self._api.request_json(
            "POST",
            f"/v1/sandboxes/{self.sandbox_id}/restore",
            operation="sandbox.restore",
            sandbox_id=self.sandbox_id,
            json_body={"snapshot_id": snapshot_id(snapshot)},
            timeout_s=LIFECYCLE_TIMEOUT_S,
        )
        self._info = SandboxInfo.from_wire(json_object(answer))
        return self._info

    async def fork(
        self, n: int = 1, *, idempotency_key: str | None = None
    ) -> builtins.list[AsyncSandbox]:
        """Make ``n`` (1 to space.limits.MAX_FORK_CHILDREN) running copies of this sandbox:
        disk, memory, processes.

        Each child has a fresh guest identity and its own connection with this one's
        configuration (close or kill each; children of a sandbox made through an
        ``AsyncSpace`` share that client's connection instead); this sandbox keeps its
        state after a brief pause. Idempotent with ``idempotency_key``, as ``create``:
        a retry returns the children the first call made. Raises InvalidArgument (``n``
        out of range, a key used with other arguments), InsufficientCapacity (its node
        has no room for all ``n``: none is made), Conflict, NotFound. Without a key, a
        cancellation mid-way may leave children behind that ``list()`` shows.
        """
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_FORK_CHILDREN:
            raise InvalidArgument(
                f"n must be 1 to {MAX_FORK_CHILDREN}, got {n!r}",
                sandbox_id=self.sandbox_id,
                operation="sandbox.fork",
            )
        answer = await self._api.request_json(
            "POST",
            f"/v1/sandboxes/{self.sandbox_id}/fork",
            operation="sandbox.fork",
            sandbox_id=self.sandbox_id,
            json_body={"count": n},
            timeout_s=LIFECYCLE_TIMEOUT_S,
            headers=idempotency_header(idempotency_key, "sandbox.fork", self.sandbox_id),
        )
        children = listed(answer, "sandboxes", operation="sandbox.fork")
        infos = [SandboxInfo.from_wire(json_object(child)) for child in children]
        return [self._sibling(info) for info in infos]

    def _sibling(self, info: SandboxInfo) -> AsyncSandbox:
        """A sandbox on a connection like this one's: its own, or the same AsyncSpace's."""
        if self._owns_api:
            return AsyncSandbox(info, ApiClient(self._api.config))
        return AsyncSandbox(info, self._api, owns_api=False)

    async def _transition(self, action: str) -> SandboxInfo:
        body = await self._api.request_json(
            "POST",
            f"/v1/sandboxes/{self.sandbox_id}/{action}",
            operation=f"sandbox.{action}",
            sandbox_id=self.sandbox_id,
            timeout_s=LIFECYCLE_TIMEOUT_S,
        )
        self._info = SandboxInfo.from_wire(json_object(body))
        return self._info

    async def kill(self) -> bool:
        """Delete the sandbox and close the connection (see ``close``).

        Idempotent: True once the sandbox is deleted, also when it already was (the API
        answers a repeated delete as done); False only if the API knows no sandbox of
        this id. Cancelling mid-way may leave the sandbox running; call again.
        """
        try:
            await self._api.request_json(
                "DELETE",
                f"/v1/sandboxes/{self.sandbox_id}",
                operation="sandbox.kill",
                sandbox_id=self.sandbox_id,
            )
        except NotFound:
            await self.close()
            return False
        await self.close()
        return True

    async def close(self) -> None:
        """Close the connection to the API; the sandbox keeps running. Idempotent.

        A sandbox made through an ``AsyncSpace`` shares that client's connection, which
        stays open (``AsyncSpace.aclose`` closes it).
        """
        if self._owns_api:
            await self._api.aclose()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.kill()


async def _get_info(api: ApiClient, sandbox_id: str) -> SandboxInfo:
    body = await api.request_json(
        "GET", f"/v1/sandboxes/{sandbox_id}", operation="sandbox.get_info", sandbox_id=sandbox_id
    )
    return SandboxInfo.from_wire(json_object(body))


async def _get_snapshots(
    api: ApiClient, path: str, sandbox_id: str | None
) -> builtins.list[SnapshotInfo]:
    operation = "snapshot.list"
    body = await api.request_json("GET", path, operation=operation, sandbox_id=sandbox_id)
    return [SnapshotInfo.from_wire(json_object(s)) for s in listed(body, "snapshots", operation)]
