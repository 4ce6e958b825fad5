"""Request and response bodies of the REST API (docs/api.md), with their limits.

Unknown fields are rejected (422); JSON types are taken strictly (``"1"`` is not a
number of cpus). Guest paths must be non-empty, without NUL, at most 4096 bytes.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from space.control.node_text import scrub
from space.control.store.repo import SandboxRecord
from space.control.store.secrets import SecretRecord
from space.control.store.snapshots import SnapshotRecord
from space.control.template_names import REF_PATTERN
from space.limits import (
    CPUS,
    DEFAULT_CPUS,
    DEFAULT_DISK_MIB,
    DEFAULT_MEMORY_MIB,
    DISK_MIB,
    ENV,
    MAX_COMMAND_TIMEOUT_S,
    MAX_FORK_CHILDREN,
    MAX_IDLE_TIMEOUT_S,
    MAX_LIFETIME_S,
    MAX_PTY_SIZE,
    MAX_SANDBOX_SECRETS,
    MAX_TIMEOUT_S,
    MEMORY_MIB,
    METADATA,
    PROCESS_TAG_PATTERN,
    MapLimit,
)
from space.node.api import (
    GUEST_CHOICES,
    EgressEvent,
    FileStat,
    PoolInfo,
    ProcessInfo,
    SandboxMetrics,
    TemplateInfo,
)

__all__ = [
    "MAX_NODE_TEMPLATES",
    "EgressEventOut",
    "ExecBody",
    "FileStatOut",
    "ForkBody",
    "GuestPath",
    "KillBody",
    "MkdirBody",
    "NodeCapacity",
    "NodeRegistration",
    "PoolOut",
    "ProcessOut",
    "PtyBody",
    "QuotaOut",
    "RenameBody",
    "RestoreBody",
    "SandboxCreate",
    "SandboxMetricOut",
    "SandboxMetricsOut",
    "SandboxOut",
    "SandboxSecretOut",
    "SecretName",
    "SecretOut",
    "SecretPut",
    "SnapshotCreate",
    "SnapshotOut",
    "TemplateOut",
    "TimeoutsBody",
    "UserName",
    "parse_mode",
    "policy_out",
]

MAX_PATH_BYTES = 4096
_USER_PATTERN = r"^[a-z_][a-z0-9_-]{0,31}$"
_MAX_TEXT = 64 * 1024
_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
#: Fields a sandbox made from a snapshot takes from the snapshot.
_FROM_SNAPSHOT = ("template", "cpus", "memory_mib", "disk_mib")


def _check_path(path: str) -> str:
    if not path:
        raise ValueError("path must not be empty")
    if "\0" in path:
        raise ValueError("path must not contain NUL")
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise ValueError(f"path must be at most {MAX_PATH_BYTES} bytes")
    return path


def _no_nul(text: str) -> str:
    if "\0" in text:
        raise ValueError("must not contain NUL")
    return text


GuestPath = Annotated[str, AfterValidator(_check_path)]
UserName = Annotated[str, Field(pattern=_USER_PATTERN)]
_Text = Annotated[str, Field(max_length=_MAX_TEXT), AfterValidator(_no_nul)]


def _bounded(limit: MapLimit, name: str) -> AfterValidator:
    def check(value: dict[str, str]) -> dict[str, str]:
        why = limit.refusal(name, value)
        if why is not None:
            raise ValueError(why)
        return value

    return AfterValidator(check)


#: An environment (a sandbox's at create, an exec's): the same bounds at both.
_Env = Annotated[dict[str, str], _bounded(ENV, "env")]
_Metadata = Annotated[dict[str, str], _bounded(METADATA, "metadata")]
#: A secret's name (as space.node.api.secret_grants.check_secret_name has it).
SecretName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class PortsBody(_Body):
    """Who may reach servers listening in a sandbox (issue 20, space.control.ports):
    nobody (``enabled`` false, the default), requests carrying its traffic token
    (``enabled``), or anyone who knows its address (``enabled`` and ``public``)."""

    enabled: bool = False
    public: bool = False

    @model_validator(mode="after")
    def _public_needs_enabled(self) -> PortsBody:
        if self.public and not self.enabled:
            raise ValueError("public ports need enabled: true")
        return self


class SandboxCreate(_Body):
    #: ``name`` (tag latest), ``name:tag`` or ``name@<digest>``: base or the tenant's own.
    template: str = Field("base", pattern=REF_PATTERN, max_length=129)
    cpus: int = Field(DEFAULT_CPUS, ge=CPUS.low, le=CPUS.high)
    memory_mib: int = Field(DEFAULT_MEMORY_MIB, ge=MEMORY_MIB.low, le=MEMORY_MIB.high)
    disk_mib: int = Field(DEFAULT_DISK_MIB, ge=DISK_MIB.low, le=DISK_MIB.high)
    #: Lifetime in seconds; null: none; omitted: the control plane's default.
    timeout_s: int | None = Field(None, ge=1, le=MAX_TIMEOUT_S)
    #: Seconds without guest activity before the sandbox is hibernated; null: never.
    idle_timeout_s: int | None = Field(None, ge=1, le=MAX_IDLE_TIMEOUT_S)
    env: _Env = Field(default_factory=dict)
    metadata: _Metadata = Field(default_factory=dict)
    #: A snapshot of the tenant's to start from (its node, template and resources).
    from_snapshot: str | None = Field(None, pattern=_ID_PATTERN)
    #: Egress policy (space.node.api.egress_policy); null: no network; omitted: none, or
    #: with from_snapshot the policy of the snapshot's sandbox.
    egress: dict[str, Any] | None = None
    #: Names of the tenant's secrets the sandbox may use (placeholders in its env);
    #: omitted with from_snapshot: those of the snapshot's sandbox.
    secrets: Annotated[list[SecretName], Field(max_length=MAX_SANDBOX_SECRETS)] = Field(
        default_factory=list
    )
    #: Port exposure; omitted: off, or with from_snapshot that of the snapshot's sandbox.
    ports: PortsBody | None = None
    #: The guest type (issue 21): ``qemu``, ``gvisor`` or ``auto`` (the node's choice).
    guest: str = "auto"

    @model_validator(mode="after")
    def _guest_is_a_choice(self) -> SandboxCreate:
        if self.guest not in GUEST_CHOICES:
            raise ValueError(f"guest must be one of {', '.join(GUEST_CHOICES)}")
        return self

    @model_validator(mode="after")
    def _resources_come_from_the_snapshot(self) -> SandboxCreate:
        given = sorted(self.model_fields_set.intersection(_FROM_SNAPSHOT))
        if self.from_snapshot is not None and given:
            raise ValueError(f"{', '.join(given)} cannot be given with from_snapshot")
        return self


class TimeoutsBody(_Body):
    """Each field optional: omitted leaves it unchanged, null removes it."""

    idle_timeout_s: int | None = Field(None, ge=1, le=MAX_IDLE_TIMEOUT_S)
    #: Counted from the sandbox's creation.
    max_lifetime_s: int | None = Field(None, ge=1, le=MAX_LIFETIME_S)


class SnapshotCreate(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class RestoreBody(_Body):
    snapshot_id: str = Field(pattern=_ID_PATTERN)


class ForkBody(_Body):
    count: int = Field(1, ge=1, le=MAX_FORK_CHILDREN)


def policy_out(policy: dict[str, Any] | None) -> dict[str, Any]:
    """A stored egress policy as the API shows it: none is ``{"allow": []}``."""
    return {"allow": []} if policy is None else policy


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()


class SandboxSecretOut(BaseModel):
    """A sandbox's use of a secret: the placeholder its environment holds as ``env``."""

    name: str
    env: str
    placeholder: str


class PortsOut(BaseModel):
    """A sandbox's port exposure as its tenant sees it: port P is reached at the Host
    ``P-<id>.<domain>`` (``domain`` null: the control plane has no sandbox domain; the
    headers ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` work either way) with
    ``traffic_token`` in ``X-Space-Traffic-Token`` or ``e2b-traffic-access-token``
    (null unless enabled and not public)."""

    enabled: bool = False
    public: bool = False
    domain: str | None = None
    traffic_token: str | None = None


class SandboxOut(BaseModel):
    id: str
    template: str
    state: str
    cpus: int
    memory_mib: int
    disk_mib: int
    env: dict[str, str]
    metadata: dict[str, Any]
    created_at: str
    expires_at: str | None
    node_id: str
    error: str | None
    idle_timeout_s: int | None
    max_lifetime_s: int | None
    last_active_at: str | None
    head_snapshot: str | None
    #: The egress policy; ``{"allow": []}`` is no network.
    egress: dict[str, Any]
    #: The secrets it may use, with their placeholders (never values).
    secrets: list[SandboxSecretOut]
    #: Whether the artifact store holds it as it is now (hibernated): it survives the
    #: loss of its node, woken on another.
    archived: bool = False
    #: Port exposure (space.control.ports); given by ``of``'s caller, who holds the
    #: domain and the key the token derives from.
    ports: PortsOut = Field(default_factory=PortsOut)
    #: The guest type asked for at create: ``qemu``, ``gvisor`` or ``auto``.
    guest: str = "auto"

    @classmethod
    def of(cls, record: SandboxRecord, ports: PortsOut | None = None) -> SandboxOut:
        return cls(
            id=record.id,
            template=record.template,
            state=record.state,
            cpus=record.cpus,
            memory_mib=record.memory_mib,
            disk_mib=record.disk_mib,
            env=record.env,
            metadata=record.metadata,
            created_at=_iso(record.created_at) or "",
            expires_at=_iso(record.expires_at),
            node_id=record.node_id,
            error=None if record.error is None else scrub(record.error),
            idle_timeout_s=record.idle_timeout_s,
            max_lifetime_s=record.max_lifetime_s,
            last_active_at=_iso(record.last_active_at),
            head_snapshot=record.head_snapshot,
            egress=policy_out(record.egress),
            secrets=[
                SandboxSecretOut(name=b.name, env=b.env, placeholder=b.placeholder)
                for b in record.secrets
            ],
            archived=record.archive is not None,
            ports=ports or PortsOut(enabled=record.ports != "off", public=record.ports == "public"),
            guest=record.guest,
        )


class SecretPut(_Body):
    """``PUT /v1/secrets/{name}``: types here, rules in space.control.broker (the node's
    own checks, space.node.api.secret_grants), so no message can echo the value."""

    value: str
    hosts: list[str]
    #: The placeholder's environment variable; null or omitted: the secret's name.
    env: str | None = None
    injection: Literal["placeholder", "header"] = "placeholder"
    #: For injection "header": the header set to ``format`` with ``{value}`` replaced.
    header: str | None = None
    format: str = "{value}"

    def __repr__(self) -> str:  # never the value
        return f"SecretPut(hosts={self.hosts!r}, env={self.env!r}, injection={self.injection!r})"

    __str__ = __repr__


class SecretOut(BaseModel):
    """A secret's metadata; the value is never answered."""

    name: str
    hosts: list[str]
    env: str
    injection: str
    header: str | None
    format: str
    created_at: str
    updated_at: str
    #: The master key that wraps its data key.
    key_id: str

    @classmethod
    def of(cls, record: SecretRecord) -> SecretOut:
        return cls(
            name=record.name,
            hosts=list(record.hosts),
            env=record.env,
            injection=record.injection,
            header=record.header,
            format=record.format,
            created_at=_iso(record.created_at) or "",
            updated_at=_iso(record.updated_at) or "",
            key_id=record.sealed.key_id,
        )


class SnapshotOut(BaseModel):
    id: str
    name: str
    sandbox_id: str
    parent_id: str | None
    node_id: str
    created_at: str
    template: str
    cpus: int
    memory_mib: int
    disk_mib: int
    memory_bytes: int
    #: Disk bytes only this snapshot holds; measured by the node on a single GET only.
    exclusive_bytes: int | None
    #: Whether the artifact store holds it: it then restores on any node.
    archived: bool = False

    @classmethod
    def of(cls, record: SnapshotRecord, exclusive_bytes: int | None = None) -> SnapshotOut:
        return cls(
            id=record.id,
            name=record.name,
            sandbox_id=record.sandbox_id,
            parent_id=record.parent_id,
            node_id=record.node_id,
            created_at=_iso(record.created_at) or "",
            template=record.template,
            cpus=record.cpus,
            memory_mib=record.memory_mib,
            disk_mib=record.disk_mib,
            memory_bytes=record.memory_bytes,
            exclusive_bytes=exclusive_bytes,
            archived=record.archived,
        )


class PtyBody(_Body):
    """A pseudo-terminal's window (issue 20)."""

    rows: int = Field(24, ge=1, le=MAX_PTY_SIZE)
    cols: int = Field(80, ge=1, le=MAX_PTY_SIZE)


class ExecBody(_Body):
    cmd: _Text | None = None
    argv: Annotated[list[_Text], Field(min_length=1, max_length=4096)] | None = None
    env: _Env = Field(default_factory=dict)
    cwd: GuestPath | None = None
    user: UserName = "user"
    #: Text sent to the process's stdin, then closed.
    stdin: Annotated[str, Field(max_length=16 * 1024 * 1024)] | None = None
    timeout_s: float | None = Field(None, gt=0, le=MAX_COMMAND_TIMEOUT_S)
    background: bool = False
    #: Keep stdin open for ``POST .../processes/{pid}/stdin`` (issue 20).
    open_stdin: bool = False
    #: Run on a pseudo-terminal: one output stream, input through ``.../stdin``.
    pty: PtyBody | None = None
    tag: Annotated[str, Field(pattern=f"^{PROCESS_TAG_PATTERN}$")] | None = None

    @model_validator(mode="after")
    def _one_command(self) -> ExecBody:
        if (self.cmd is None) == (self.argv is None):
            raise ValueError("give exactly one of cmd and argv")
        if self.stdin is not None and (self.open_stdin or self.pty is not None):
            raise ValueError("stdin up front excludes open_stdin and pty")
        return self


class KillBody(_Body):
    signal: int = Field(9, ge=1, le=64)


class MkdirBody(_Body):
    path: GuestPath
    user: UserName = "user"


class RenameBody(_Body):
    src: GuestPath
    dst: GuestPath
    user: UserName = "user"


#: Bounds of a node's report: no node has more (a hostile body stores no more).
_MAX_MIB = 2**40
#: Templates and pools a node reports at most (more are left out of its report).
MAX_NODE_TEMPLATES = 1024
_NodeTemplate = Annotated[str, Field(min_length=1, max_length=160)]


class NodeCapacity(_Body):
    """What a node has, sent with each heartbeat (issue 19); placement ranks by it."""

    vcpus: int = Field(ge=1, le=65536)
    memory_mib: int = Field(ge=0, le=_MAX_MIB)
    memory_available_mib: int = Field(ge=0, le=_MAX_MIB)
    disk_mib: int = Field(ge=0, le=_MAX_MIB)
    disk_free_mib: int = Field(ge=0, le=_MAX_MIB)
    guest_types: list[Annotated[str, Field(pattern=r"^[a-z0-9-]{1,32}$")]] = Field(
        min_length=1, max_length=8
    )
    #: How many more sandboxes of the default shape the node would admit now.
    room: int = Field(ge=0, le=1_000_000)
    #: Templates built on the node (each has its ready state there).
    templates: list[_NodeTemplate] = Field(default_factory=list, max_length=MAX_NODE_TEMPLATES)
    #: Warm pools: template → paused VMs waiting now.
    pools: dict[_NodeTemplate, Annotated[int, Field(ge=0, le=1_000_000)]] = Field(
        default_factory=dict, max_length=MAX_NODE_TEMPLATES
    )
    #: Whether the node keeps snapshots and hibernated sandboxes in an artifact store.
    archives: bool = False


class NodeRegistration(_Body):
    """A node's registration, and each of its heartbeats (the same call renews its
    lease)."""

    node_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    url: str = Field(pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$", max_length=2048)
    #: None from a node agent older than issue 19: placed on, but holding no lease.
    capacity: NodeCapacity | None = None


class FileStatOut(BaseModel):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float
    owner: str

    @classmethod
    def of(cls, stat: FileStat) -> FileStatOut:
        return cls(
            name=stat.name,
            path=stat.path,
            type=stat.type,
            size=stat.size,
            mode=stat.mode,
            mtime=stat.mtime,
            owner=stat.owner,
        )


class ProcessOut(BaseModel):
    process_id: str
    pid: int
    argv: list[str] | None
    cmd: str | None
    running: bool
    exit_code: int | None
    signal: int | None
    started_at: str
    tag: str | None = None
    pty: bool = False

    @classmethod
    def of(cls, info: ProcessInfo) -> ProcessOut:
        return cls(
            process_id=info.process_id,
            pid=info.pid,
            argv=info.argv,
            cmd=info.cmd,
            running=info.running,
            exit_code=info.exit_code,
            signal=info.signal,
            started_at=_iso(info.started_at) or "",
            tag=info.tag,
            pty=info.pty,
        )


class EgressEventOut(BaseModel):
    """One egress decision (``GET .../egress/log``); secrets by name only."""

    time: str
    #: "dns", "tcp", "tls" or "http".
    protocol: str
    host: str | None
    address: str | None
    port: int | None
    #: "allow" or "deny", and why; "drop" (protocol "audit"): the audit's own note of
    #: how many events it dropped over the sandbox's write budget.
    decision: str
    reason: str
    bytes_out: int
    bytes_in: int
    secrets: list[str]

    @classmethod
    def of(cls, event: EgressEvent) -> EgressEventOut:
        return cls(
            time=_iso(event.time) or "",
            protocol=event.protocol,
            host=event.host,
            address=event.address,
            port=event.port,
            decision=event.decision,
            reason=event.reason,
            bytes_out=event.bytes_out,
            bytes_in=event.bytes_in,
            secrets=list(event.secrets),
        )


class EgressLogOut(BaseModel):
    """``GET .../egress/log``: the latest decisions, oldest first, and how many the
    node's audit dropped over the sandbox's write budget (50/s, bursts of 200) since the
    sandbox began."""

    events: list[EgressEventOut]
    dropped: int


class SandboxMetricOut(BaseModel):
    """One sample of a sandbox's resource use: E2B's SandboxMetric in snake_case (its
    ``timestampUnix``, ``cpuUsedPct``, ``memUsed``... are ours with underscores). Sizes
    in bytes; ``cpu_used_pct`` is the share of all vCPUs busy since the sample before."""

    timestamp: str
    timestamp_unix: int
    cpu_count: int
    cpu_used_pct: float = Field(ge=0, le=100)
    mem_used: int
    mem_total: int
    disk_used: int
    disk_total: int

    @classmethod
    def of(cls, sample: SandboxMetrics) -> SandboxMetricOut:
        return cls(
            timestamp=_iso(sample.timestamp) or "",
            timestamp_unix=int(sample.timestamp),
            cpu_count=sample.cpu_count,
            cpu_used_pct=sample.cpu_used_pct,
            mem_used=sample.mem_used,
            mem_total=sample.mem_total,
            disk_used=sample.disk_used,
            disk_total=sample.disk_total,
        )


class SandboxMetricsOut(BaseModel):
    """``GET /v1/sandboxes/{id}/metrics``: the samples kept, oldest first."""

    metrics: list[SandboxMetricOut]


class PoolOut(BaseModel):
    """One node's warm pool of one template (``GET /v1/pools``): no tenant data."""

    node_id: str
    template: str
    #: Paused VMs waiting now, and how many the pool is filling towards.
    size: int
    target: int
    min_size: int
    max_size: int
    #: Creates served from the pool, and creates of the pool's shape it could not serve.
    hits: int
    misses: int
    #: hits / (hits + misses); null before the first such create.
    hit_rate: float | None = Field(ge=0, le=1)

    @classmethod
    def of(cls, node_id: str, pool: PoolInfo) -> PoolOut:
        served = pool.hits + pool.misses
        return cls(
            node_id=node_id,
            template=pool.template,
            size=pool.size,
            target=pool.target,
            min_size=pool.min_size,
            max_size=pool.max_size,
            hits=pool.hits,
            misses=pool.misses,
            hit_rate=pool.hits / served if served else None,
        )


class TemplateOut(BaseModel):
    """One tag of a template (``GET /v1/templates``), in the tenant's own names."""

    name: str
    tag: str
    #: The build's content digest, 64 lowercase hex digits.
    digest: str
    created_at: str
    #: ``debian:<release>``, ``template:<name>:<tag>`` or ``template@<digest>``.
    base: str
    cpus: int
    memory_mib: int
    disk_mib: int
    env: dict[str, str]
    workdir: str | None
    start: str | None
    #: Whether sandboxes of its exact shape start from a saved, booted state.
    ready: bool

    @classmethod
    def of(cls, info: TemplateInfo, *, name: str, base: str) -> TemplateOut:
        """``info`` shown as ``name`` with ``base``, both already in the tenant's names."""
        return cls(
            name=name,
            tag=info.tag,
            digest=info.digest,
            created_at=_iso(info.created_at) or "",
            base=base,
            cpus=info.cpus,
            memory_mib=info.memory_mib,
            disk_mib=info.disk_mib,
            env=dict(info.env),
            workdir=info.workdir,
            start=info.start,
            ready=info.ready,
        )


_MODE_RE = re.compile(r"^[0-7]{1,4}$")


def parse_mode(text: str) -> int:
    """An octal permission string ("644") as an int; raises ValueError otherwise."""
    if not _MODE_RE.fullmatch(text):
        raise ValueError(f"mode must be octal digits like 644, not {text!r}")
    return int(text, 8)


class QuotaOut(BaseModel):
    """One quota of the caller's tenant (``GET /v1/quota``; space.control.quotas)."""

    #: The most the tenant may hold, and what it holds now, in ``unit``.
    limit: int
    used: int
    unit: str
