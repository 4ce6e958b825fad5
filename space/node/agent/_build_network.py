"""The network of a template build VM: the spec's ``build_egress`` policy, for run steps.

Private to space.node.agent. A build VM boots with a NIC in its own namespace like any
sandbox (closed). If the spec allows anything, the gateway serves the namespace under
that policy with a CA of the build VM's own, and nftables opens. The CA is trusted by
the guest only while a run step runs: it is removed before the step's disk becomes a
layer, so no template (nor a later build on a cached layer) trusts the CA of the VM it
was built in. Without a policy the namespace stays closed and nothing is attached.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from space.node.api import EgressPolicy, NodeError
from space.node.channel import GuestChannel
from space.node.core.sandbox import LiveSandbox, has_nic
from space.node.egress.audit import AuditLog
from space.node.network import ca, netns
from space.node.network.gateway_client import GatewayProcess
from space.node.network.trust import TRUST_ENV, install_ca, remove_ca

__all__ = ["BuildNetwork", "open_build_network"]

log = logging.getLogger(__name__)

#: Refusals quoted in a failed step's error, at most.
MAX_REFUSALS = 5
OFFLINE_HINT = (
    "the build VM has no network: allow what run steps need in the spec's build_egress "
    "(docs/templates.md)"
)
#: What failing to reach the network looks like in the output of common tools.
_OFFLINE_SIGNS = re.compile(
    r"temporary failure in name resolution|name or service not known|could not resolve"
    r"|network is unreachable|no route to host|failed to establish a new connection"
    r"|getaddrinfo|name resolution",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class BuildNetwork:
    """What a run step of the build needs of the network; ``ca_file`` None: none."""

    vm_id: str
    ca_file: Path | None
    audit: AuditLog

    @property
    def env(self) -> dict[str, str]:
        """Variables pointing tools with their own CA bundle at the guest's."""
        return dict(TRUST_ENV) if self.ca_file is not None else {}

    @contextlib.asynccontextmanager
    async def trusted(self, channel: GuestChannel) -> AsyncIterator[None]:
        """The guest trusts the build's CA inside the block. After a failure the CA
        stays: the build ends there and its VM goes, no layer is kept."""
        if self.ca_file is None:
            yield
            return
        pem = ca.certificate_pem(self.ca_file)
        subject_hash = ca.subject_hash(pem)
        await install_ca(channel, pem, subject_hash)
        yield
        await remove_ca(channel, pem, subject_hash)

    def offline_hint(self, output: str) -> str | None:
        """OFFLINE_HINT if the build has no network and ``output`` (a failed step's)
        looks like a tool that tried to reach it."""
        if self.ca_file is not None or not _OFFLINE_SIGNS.search(output):
            return None
        return OFFLINE_HINT

    async def refusals(self, since: float) -> list[str]:
        """The gateway's refusals for the build VM from ``since`` (epoch seconds) on,
        one line each ("pypi.org:443: <reason>"), oldest first, deduplicated."""
        if self.ca_file is None:
            return []
        events = await asyncio.to_thread(self.audit.read, self.vm_id, 1000)
        lines: list[str] = []
        for event in events:
            if event.time < since or event.decision != "deny":
                continue
            where = event.host or event.address or "?"
            line = f"{where}{'' if event.port is None else f':{event.port}'}: {event.reason}"
            if line not in lines:
                lines.append(line)
        return lines[-MAX_REFUSALS:]


@contextlib.asynccontextmanager
async def open_build_network(
    gateway: GatewayProcess, ca_dir: Path, audit: AuditLog, vm: LiveSandbox, policy: EgressPolicy
) -> AsyncIterator[BuildNetwork]:
    """The build VM's network under ``policy`` inside the block; detached after (the
    namespace, CA and audit log go with the VM). Raises Unavailable, InvalidArgument."""
    if policy.closed or not has_nic(vm.volume):
        yield BuildNetwork(vm.sandbox_id, None, audit)
        return
    name = netns.netns_name(vm.config.run_dir)
    ca_file = ca.ensure_ca(ca_dir, vm.sandbox_id)
    await gateway.attach(vm.sandbox_id, netns.netns_path(name), policy.to_json(), ca_file)
    try:
        await netns.set_open(vm.config.run_dir.parent, name, True)
        yield BuildNetwork(vm.sandbox_id, ca_file, audit)
    finally:
        try:
            await asyncio.shield(gateway.detach(vm.sandbox_id))
        except NodeError as exc:
            log.error("build VM %s: detaching its network failed: %s", vm.sandbox_id, exc)
