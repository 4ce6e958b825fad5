"""E2B's wire shapes (camelCase, as the e2b 2.x SDK's models read and write them) and
what each maps to in SPACE.

Requests are pydantic models with E2B's field names; fields the SDK may send that SPACE
cannot honour are accepted only at their neutral value and otherwise refused (400)
naming the field, never silently dropped. Answers are built here from our records.

States: E2B knows ``running`` and ``paused``. A creating sandbox shows as running, a
paused or hibernated one as paused; any other state (stopped, error, lost) is not an E2B
sandbox: it is left out of lists and a lookup of it is 404.

Timeouts: E2B's ``timeout`` is seconds from now until the sandbox ends. A sandbox
created with ``autoPause`` has no lifetime but an idle timeout of that many seconds
(SPACE hibernates it then, and it shows as paused); any other has a lifetime ending
``timeout`` seconds from now (SPACE deletes it then).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from space.control.access_tokens import TokenPurpose, sandbox_token
from space.control.deps import ControlContext
from space.control.e2b._network import network_info
from space.control.ports import ports_out
from space.control.store.repo import SandboxRecord
from space.control.store.snapshots import SnapshotRecord
from space.limits import MAX_FORK_CHILDREN, MAX_TIMEOUT_S
from space.node.api import SandboxMetrics, SandboxState

__all__ = [
    "ENVD_VERSION",
    "E2BConnect",
    "E2BFork",
    "E2BNetwork",
    "E2BNetworkUpdate",
    "E2BNewSandbox",
    "E2BPause",
    "E2BResume",
    "E2BSnapshot",
    "E2BTimeout",
    "created_sandbox",
    "e2b_state",
    "end_at",
    "listed_sandbox",
    "metric",
    "sandbox_detail",
    "snapshot_info",
]

#: The envd version every sandbox reports. The SDK gates features on it
#: (e2b.envd.versions: the newest gate is 0.6.4, watching network mounts; metrics need
#: 0.2.4): this one passes them all, so the SDK never refuses a call client-side.
ENVD_VERSION = "0.6.4"

#: SPACE states as E2B's two.
_E2B_STATE = {
    SandboxState.CREATING.value: "running",
    SandboxState.RUNNING.value: "running",
    SandboxState.PAUSED.value: "paused",
    SandboxState.HIBERNATED.value: "paused",
}

Timeout = Annotated[int, Field(ge=1, le=MAX_TIMEOUT_S)]
_Map = dict[str, str]


class _Body(BaseModel):
    # Unknown fields are refused: a field the SDK grew that we do not map must not be
    # silently ignored. Types are strict, as in our own API.
    model_config = ConfigDict(extra="forbid", strict=True)


class E2BFlag(_Body):
    enabled: bool


class E2BNetwork(_Body):
    """E2B's ``network``. SPACE's egress policy is an allow-list, so ``denyOut`` may only
    be all traffic (then ``allowOut`` is the whole list)."""

    allowOut: list[Annotated[str, Field(max_length=253)]] | None = Field(None, max_length=256)
    denyOut: list[Annotated[str, Field(max_length=253)]] | None = Field(None, max_length=256)
    allowPublicTraffic: bool | None = None
    rules: dict[str, Any] | None = None
    egressProxy: dict[str, Any] | None = None
    dnsServers: list[str] | None = None
    maskRequestHost: str | None = None
    httpsPorts: list[int] | None = None


class E2BNetworkUpdate(_Body):
    """``PUT /sandboxes/{id}/network``: the whole new configuration (omitted: cleared)."""

    allowOut: list[Annotated[str, Field(max_length=253)]] | None = Field(None, max_length=256)
    denyOut: list[Annotated[str, Field(max_length=253)]] | None = Field(None, max_length=256)
    allow_internet_access: bool | None = None
    rules: dict[str, Any] | None = None
    egressProxy: dict[str, Any] | None = None
    dnsServers: list[str] | None = None

    def as_network(self) -> E2BNetwork:
        return E2BNetwork.model_validate(self.model_dump(exclude={"allow_internet_access"}))


class E2BNewSandbox(_Body):
    """``POST /v2/sandboxes`` (E2B's NewSandboxV2)."""

    templateID: str = Field(min_length=1, max_length=129)
    #: Omitted: the control plane's default lifetime (ControlSettings.default_timeout_s).
    timeout: Timeout | None = None
    autoPause: bool = False
    autoPauseMemory: bool = True
    autoResume: E2BFlag | None = None
    allow_internet_access: bool | None = None
    network: E2BNetwork | None = None
    metadata: _Map = Field(default_factory=dict)
    envVars: _Map = Field(default_factory=dict)
    mcp: dict[str, Any] | None = None
    iam: dict[str, Any] | None = None
    volumeMounts: list[dict[str, Any]] | None = None
    secure: bool = True


class E2BTimeout(_Body):
    timeout: Timeout


class E2BConnect(_Body):
    timeout: Timeout = 300
    memory: bool = True


class E2BResume(_Body):
    timeout: Timeout = 15
    autoPause: bool | None = None
    memory: bool = True


class E2BPause(_Body):
    memory: bool = True
    requireHealthyGuest: bool = False


class E2BFork(_Body):
    timeout: Timeout | None = None
    count: int = Field(1, ge=1, le=MAX_FORK_CHILDREN)


class E2BSnapshot(_Body):
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    memory: bool = True


def e2b_state(record: SandboxRecord) -> str | None:
    """``running`` or ``paused``; None for a state E2B does not show."""
    return _E2B_STATE.get(record.state)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def auto_pauses(record: SandboxRecord) -> bool:
    """Whether the sandbox was made with ``autoPause``: an idle timeout, no lifetime."""
    return record.expires_at is None and record.idle_timeout_s is not None


def end_at(record: SandboxRecord) -> float:
    """When the sandbox's timeout ends: its lifetime's end, or for an auto-pausing one
    its idle timeout from its last activity; one without either runs the longest E2B
    timeout from its creation (E2B has no "never")."""
    if record.expires_at is not None:
        return record.expires_at
    since = record.last_active_at or record.created_at
    return since + (record.idle_timeout_s or MAX_TIMEOUT_S)


def _common(record: SandboxRecord) -> dict[str, Any]:
    return {
        "templateID": record.template,
        "sandboxID": record.id,
        "clientID": record.node_id,
        "startedAt": _iso(record.created_at),
        "endAt": _iso(end_at(record)),
        "cpuCount": record.cpus,
        "memoryMB": record.memory_mib,
        "diskSizeMB": record.disk_mib,
        "state": e2b_state(record),
        "envdVersion": ENVD_VERSION,
        "metadata": record.metadata,
    }


def listed_sandbox(record: SandboxRecord) -> dict[str, Any]:
    """E2B's ListedSandbox."""
    return _common(record)


def sandbox_detail(ctx: ControlContext, record: SandboxRecord) -> dict[str, Any]:
    """E2B's SandboxDetail."""
    internet, network = network_info(record.egress)
    return {
        **_common(record),
        "envdAccessToken": sandbox_token(ctx.node_token, record.id, TokenPurpose.ENVD),
        "allowInternetAccess": internet,
        "network": network,
        "domain": ctx.settings.sandbox_domain or None,
        "lifecycle": {
            "onTimeout": "pause" if auto_pauses(record) else "kill",
            "autoResume": False,
        },
    }


def created_sandbox(ctx: ControlContext, record: SandboxRecord) -> dict[str, Any]:
    """E2B's Sandbox: the answer of create, connect, resume and fork."""
    return {
        "templateID": record.template,
        "sandboxID": record.id,
        "clientID": record.node_id,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": sandbox_token(ctx.node_token, record.id, TokenPurpose.ENVD),
        # None for public ports, as E2B's: nothing to send.
        "trafficAccessToken": ports_out(ctx, record).traffic_token,
        "domain": ctx.settings.sandbox_domain or None,
    }


def metric(sample: SandboxMetrics) -> dict[str, Any]:
    """E2B's SandboxMetric (sizes in bytes). SPACE does not sample the page cache:
    ``memCache`` is 0."""
    return {
        "timestamp": _iso(sample.timestamp),
        "timestampUnix": int(sample.timestamp),
        "cpuCount": sample.cpu_count,
        "cpuUsedPct": sample.cpu_used_pct,
        "memUsed": sample.mem_used,
        "memTotal": sample.mem_total,
        "memCache": 0,
        "diskUsed": sample.disk_used,
        "diskTotal": sample.disk_total,
    }


def snapshot_info(record: SnapshotRecord) -> dict[str, Any]:
    """E2B's SnapshotInfo: its id is what ``Sandbox.create`` takes as the template."""
    return {"snapshotID": record.id, "names": [record.name]}


def lifetime_for(record: SandboxRecord, timeout_s: int, now: float) -> int:
    """The lifetime (from creation) that ends ``timeout_s`` seconds after ``now``."""
    return max(1, math.ceil(now + timeout_s - record.created_at))
