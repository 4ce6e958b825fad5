"""The egress side of a node: each sandbox's namespace, policy and audit log.

``SandboxNetwork`` is the plumbing: it tells the gateway about a sandbox's namespace,
opens or closes its nftables to match the policy, installs the sandbox's CA in its
guest and takes it all down again. ``Egress`` is the service behind the NodeService
calls (set_egress, set_secrets, egress_log). A sandbox's namespace is made when its VM
first starts (space.node.core.sandbox) and goes with the sandbox. The policy is part of
the sandbox's persisted spec, so a restarted node applies it again. Every method raises
space.node.api errors only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from space.limits import MAX_EGRESS_LOG_EVENTS
from space.node.agent._build_network import BuildNetwork, open_build_network
from space.node.agent._hidden import is_hidden
from space.node.api import (
    EgressLog,
    EgressPolicy,
    InvalidArgument,
    NodeError,
    PolicyBounds,
    SandboxState,
    SecretGrant,
    Unavailable,
    check_grants,
    host_addresses,
)
from space.node.core.sandbox import LiveSandbox
from space.node.egress.audit import AuditLog
from space.node.network import ca, netns
from space.node.network.gateway_client import GatewayProcess
from space.node.network.trust import install_ca

if TYPE_CHECKING:
    from space.node.agent._registry import Registry

__all__ = ["Egress", "SandboxNetwork", "parse_policy"]

log = logging.getLogger(__name__)


def parse_policy(
    policy: dict[str, object] | None, sandbox_id: str, bounds: PolicyBounds
) -> EgressPolicy:
    """The policy as the gateway will apply it, within the operator's ``bounds`` and
    the host's addresses of now; InvalidArgument (naming the sandbox and the rule)."""
    within = replace(bounds, own_addresses=host_addresses())
    try:
        return EgressPolicy.parse(policy if policy is not None else {}, within)
    except InvalidArgument as exc:
        raise InvalidArgument(f"egress policy: {exc.message}", sandbox_id=sandbox_id) from exc


class SandboxNetwork:
    """The network of the node's sandboxes: gateway, namespaces, CAs and audit logs."""

    def __init__(
        self,
        gateway: GatewayProcess,
        *,
        audit: AuditLog,
        ca_dir: Path,
        run_root: Path,
        bounds: PolicyBounds | None = None,
    ) -> None:
        self.gateway = gateway
        #: What tenants' policies may name (NodeConfig.egress_bounds; None: strictest).
        self.bounds = bounds or PolicyBounds()
        self.audit = audit
        self._ca_dir = ca_dir
        self._run_root = run_root

    async def apply(self, sandbox: LiveSandbox, *, adopt: bool = False) -> None:
        """Tell the gateway and nftables the sandbox's policy (a VM without a NIC has no
        namespace: nothing to do; a gVisor sandbox's namespace is governed as a VM's).
        Opening goes gateway first, closing nftables first, so the guest never reaches
        a gateway that does not know its policy. A closed policy costs nothing where
        nothing changes: a ruleset known closed is not written again, and the gateway
        learns of a sandbox only once a policy opened it (nothing else reaches it),
        but at a node's start (``adopt``), when an adopted gateway may hold its
        secrets."""
        if not sandbox.has_network:
            return
        name = netns.netns_name(sandbox.config.run_dir)
        policy = parse_policy(sandbox.record.spec.egress, sandbox.sandbox_id, self.bounds)
        # Gone after a host reboot; a no-op otherwise.
        if await netns.create(self._run_root, name, veth=sandbox.record.guest == "gvisor"):
            sandbox.ruleset_open = False
        if policy.closed:
            if sandbox.ruleset_open is not False:
                await self._set_open(sandbox, name, False)
            if not (adopt or self.gateway.serves(sandbox.sandbox_id)):
                return
        ca_file = ca.ensure_ca(self._ca_dir, sandbox.sandbox_id)
        path = netns.netns_path(name)
        await self.gateway.attach(sandbox.sandbox_id, path, policy.to_json(), ca_file)
        if not policy.closed:
            await self._trust(sandbox, ca_file)
            await self._set_open(sandbox, name, True)

    async def _set_open(self, sandbox: LiveSandbox, name: str, is_open: bool) -> None:
        sandbox.ruleset_open = None  # not known until nft has applied it
        await netns.set_open(self._run_root, name, is_open)
        sandbox.ruleset_open = is_open

    async def trust_after_resume(self, sandbox: LiveSandbox) -> None:
        """A policy opened while the sandbox was paused or hibernated could not install
        the CA in its guest then; it is installed now (a no-op once it is there). The
        sandbox runs either way, so a failure is logged, not raised."""
        policy = parse_policy(sandbox.record.spec.egress, sandbox.sandbox_id, self.bounds)
        if policy.closed or not sandbox.has_network:
            return
        try:
            await self._trust(sandbox, ca.ensure_ca(self._ca_dir, sandbox.sandbox_id))
        except (NodeError, OSError) as exc:
            log.error("sandbox %s: installing the egress CA failed: %s", sandbox.sandbox_id, exc)

    async def _trust(self, sandbox: LiveSandbox, ca_file: Path) -> None:
        """Install the sandbox's CA in its guest, once per guest filesystem (a restore
        or a fork brings another one: those start with ``trusted_ca`` None)."""
        pem = ca.certificate_pem(ca_file)
        if sandbox.trusted_ca == pem or sandbox.record.state != SandboxState.RUNNING:
            return
        channel = sandbox.channel
        if channel is None or channel.closed:
            raise Unavailable(
                "no guest channel to install the egress CA", sandbox_id=sandbox.sandbox_id
            )
        await install_ca(channel, pem, ca.subject_hash(pem))
        sandbox.trusted_ca = pem

    def for_build(
        self, vm: LiveSandbox, policy: EgressPolicy
    ) -> AbstractAsyncContextManager[BuildNetwork]:
        """The build VM's network under ``policy`` (a spec's ``build_egress``, read
        without bounds): InvalidArgument if the node's bounds refuse one of its rules."""
        bounded = parse_policy(policy.to_json(), vm.sandbox_id, self.bounds)
        return open_build_network(self.gateway, self._ca_dir, self.audit, vm, bounded)

    async def drop(self, sandbox_id: str, run_dir: Path) -> None:
        """Detach the gateway and delete the namespace and audit log; logs failures."""
        try:
            if not is_hidden(sandbox_id):
                await self.gateway.detach(sandbox_id)
            await netns.delete(self._run_root, netns.netns_name(run_dir))
            ca.remove_ca(self._ca_dir, sandbox_id)
        except (NodeError, OSError) as exc:
            log.error("sandbox %s: removing its network failed: %s", sandbox_id, exc)
        await asyncio.to_thread(self.audit.remove, sandbox_id)

    async def at_start(self, sandboxes: Iterable[LiveSandbox], say: Callable[[str], None]) -> None:
        """Apply every sandbox's policy again (an adopted gateway keeps its connections
        through that), detach the gateway from sandboxes gone meanwhile, and delete
        namespaces no sandbox owns."""
        owned = set()
        for sandbox in sandboxes:
            owned.add(netns.netns_name(sandbox.config.run_dir))
            if sandbox.record.state == SandboxState.ERROR:
                continue
            try:
                await self.apply(sandbox, adopt=True)
            except NodeError as exc:
                say(f"sandbox {sandbox.sandbox_id}: applying its egress policy failed: {exc}")
        try:
            await self.gateway.retain()
        except NodeError as exc:
            say(f"detaching stale sandboxes from the egress gateway failed: {exc}")
        for name in netns.node_netns(self._run_root):
            if name not in owned:
                say(f"removing stray network namespace {name}")
                try:
                    await netns.delete(self._run_root, name)
                except (Unavailable, OSError) as exc:
                    say(f"cannot remove {name}: {exc}")


class Egress:
    """Policies, secrets and audit logs of the node's sandboxes."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._network = registry.network

    async def set_egress(self, sandbox_id: str, policy: dict[str, object] | None) -> None:
        """Replace the sandbox's egress policy; new connections and DNS follow it at
        once and connections it no longer allows are cut. Persisted first. Raises
        NotFound, InvalidArgument (the policy; the old one stays), Unavailable."""
        parsed = parse_policy(policy, sandbox_id, self._network.bounds)
        canonical = parsed.to_json()
        async with self._registry.lock(sandbox_id):
            sandbox = self._registry.get(sandbox_id)
            if sandbox.record.guest == "gvisor" and not parsed.closed and not sandbox.has_network:
                raise InvalidArgument(
                    "this gvisor sandbox has no network to open: it was made before gvisor "
                    "sandboxes had one (a sandbox made now has)",
                    sandbox_id=sandbox_id,
                )
            spec = replace(sandbox.record.spec, egress=canonical)
            sandbox.record = replace(sandbox.record, spec=spec)
            self._registry.store.save(sandbox.record)
            await self._network.apply(sandbox)

    async def set_secrets(self, sandbox_id: str, grants: list[SecretGrant]) -> None:
        """Replace the secrets the gateway may inject for the sandbox (held in memory
        by the gateway only). Raises NotFound, InvalidArgument (a grant; the old ones
        stay), Unavailable."""
        try:
            check_grants(grants)
        except InvalidArgument as exc:
            raise InvalidArgument(f"secrets: {exc.message}", sandbox_id=sandbox_id) from exc
        async with self._registry.lock(sandbox_id):
            self._registry.get(sandbox_id)
            await self._network.gateway.set_secrets(sandbox_id, grants)

    async def egress_log(self, sandbox_id: str, *, limit: int = 100) -> EgressLog:
        """The sandbox's latest ``limit`` (1..1000) egress decisions, oldest first, and
        how many its audit dropped over the write budget."""
        if not 1 <= limit <= MAX_EGRESS_LOG_EVENTS:
            raise InvalidArgument(
                f"limit must be 1..{MAX_EGRESS_LOG_EVENTS}", sandbox_id=sandbox_id
            )
        self._registry.get(sandbox_id)
        audit = self._network.audit
        events = await asyncio.to_thread(audit.read, sandbox_id, limit)
        return EgressLog(events, await asyncio.to_thread(audit.dropped, sandbox_id))
