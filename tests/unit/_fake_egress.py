"""FakeNode's egress: the policy each sandbox was last given, and canned log events.

``egress`` holds each sandbox's policy as the node got it (at create, fork or
set_egress); ``egress_events`` is what ``egress_log`` answers for a sandbox (set it in
a test), the latest ``limit`` of them, with ``egress_dropped`` its drop count. A
malformed policy is refused as the node does.
"""

from __future__ import annotations

from typing import Any

from space.node.api import EgressEvent, EgressLog, EgressPolicy

__all__ = ["CANNED_EVENTS", "FakeEgress"]

#: What egress_log answers for a sandbox no test scripted: one allow, one deny.
CANNED_EVENTS = (
    EgressEvent(1_800_000_000.5, "tls", "pypi.org", "151.101.0.223", 443, "allow", "policy",
                bytes_out=517, bytes_in=4096, secrets=("PYPI_TOKEN",)),
    EgressEvent(1_800_000_001.0, "dns", "evil.example", None, None, "deny", "no rule for host"),
)  # fmt: skip


class FakeEgress:
    """The egress half of FakeNode; ``_box`` (FakeNode's) checks the sandbox exists."""

    def __init__(self) -> None:
        self.egress: dict[str, dict[str, object] | None] = {}
        self.egress_events: dict[str, list[EgressEvent]] = {}
        self.egress_dropped: dict[str, int] = {}

    def _box(self, method: str, sandbox_id: str) -> Any:
        raise NotImplementedError  # FakeNode's

    async def set_egress(self, sandbox_id: str, policy: dict[str, object] | None) -> None:
        self._box("set_egress", sandbox_id)
        if policy is not None:
            EgressPolicy.parse(policy)  # InvalidArgument, the old policy kept
        self.egress[sandbox_id] = policy

    async def egress_log(self, sandbox_id: str, *, limit: int = 100) -> EgressLog:
        self._box("egress_log", sandbox_id)
        events = self.egress_events.get(sandbox_id, list(CANNED_EVENTS))
        return EgressLog(events[-limit:], self.egress_dropped.get(sandbox_id, 0))
