"""Value objects the SDK returns, parsed from the wire shapes in docs/api.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, overload

from space.sdk.errors import InternalError

__all__ = [
    "CommandResult",
    "EgressEvent",
    "EgressLog",
    "FileInfo",
    "PoolInfo",
    "PortsInfo",
    "ProcessInfo",
    "PtySize",
    "SandboxInfo",
    "SecretBinding",
    "SecretInfo",
    "SnapshotInfo",
    "TemplateInfo",
]


@dataclass(frozen=True, slots=True)
class SecretBinding:
    """A sandbox's use of a secret: its environment holds ``placeholder`` as ``env``, and
    the gateway puts the value in its place on requests to the secret's hosts."""

    name: str
    env: str
    placeholder: str

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> SecretBinding:
        return cls(
            name=_required_str(body, "name"),
            env=_required_str(body, "env"),
            placeholder=_required_str(body, "placeholder"),
        )


@dataclass(frozen=True, slots=True)
class PortsInfo:
    """Who may reach servers listening in a sandbox (docs/api.md "Ports"): nobody
    (``enabled`` False), holders of ``traffic_token`` (sent as ``X-Space-Traffic-Token``
    or ``e2b-traffic-access-token``), or anyone (``public``). Port P is at the host
    ``P-<sandbox id>.<domain>``; ``domain`` is None where the platform has no sandbox
    domain (the headers ``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` then address it)."""

    enabled: bool = False
    public: bool = False
    domain: str | None = None
    traffic_token: str | None = None

    @classmethod
    def from_wire(cls, body: object) -> PortsInfo:
        if not isinstance(body, Mapping):
            return cls()
        return cls(
            enabled=body.get("enabled") is True,
            public=body.get("public") is True,
            domain=_optional_str(body, "domain"),
            traffic_token=_optional_str(body, "traffic_token"),
        )


@dataclass(frozen=True, slots=True)
class SandboxInfo:
    """One sandbox as the API reports it (``GET /v1/sandboxes/{id}``).

    ``state`` is ``creating``, ``running``, ``paused``, ``hibernated``, ``error`` or
    ``lost`` (its node stopped heartbeating: only delete works until the node is back;
    ``error`` says which node).
    ``idle_timeout_s`` hibernates it after that many seconds without activity (commands,
    file calls; the last at ``last_active_at``); ``max_lifetime_s`` deletes it that long
    after ``created_at`` (at ``expires_at``); None means no such limit.
    ``head_snapshot`` is the snapshot it last came from or took: the parent of its next
    snapshot. ``error`` says why a sandbox in state ``error`` is there (its VM exited,
    its guest broke the protocol...); None otherwise. ``archived``: the platform's
    artifact store holds it as it is now (a hibernated sandbox), so it survives the
    loss of its node. ``ports``: who may reach servers listening in it (PortsInfo).
    """

    sandbox_id: str
    template: str
    state: str
    cpus: int
    memory_mib: int
    disk_mib: int
    env: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    created_at: datetime | None = None
    expires_at: datetime | None = None
    node_id: str | None = None
    idle_timeout_s: int | None = None
    max_lifetime_s: int | None = None
    last_active_at: datetime | None = None
    head_snapshot: str | None = None
    secrets: tuple[SecretBinding, ...] = ()
    error: str | None = None
    archived: bool = False
    ports: PortsInfo = field(default_factory=PortsInfo)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> SandboxInfo:
        """Parse a Sandbox object; raises InternalError if it is malformed."""
        try:
            return cls(
                sandbox_id=str(body["id"]),
                template=str(body["template"]),
                state=str(body["state"]),
                cpus=int(body["cpus"]),
                memory_mib=int(body["memory_mib"]),
                disk_mib=int(body["disk_mib"]),
                env=dict(body.get("env") or {}),
                metadata=dict(body.get("metadata") or {}),
                created_at=_parse_time(body.get("created_at")),
                expires_at=_parse_time(body.get("expires_at")),
                node_id=body.get("node_id"),
                idle_timeout_s=_optional_int(body, "idle_timeout_s"),
                max_lifetime_s=_optional_int(body, "max_lifetime_s"),
                last_active_at=_parse_time(body.get("last_active_at")),
                head_snapshot=_optional_str(body, "head_snapshot"),
                secrets=tuple(SecretBinding.from_wire(b) for b in body.get("secrets") or ()),
                error=_optional_str(body, "error"),
                archived=body.get("archived") is True,
                ports=PortsInfo.from_wire(body.get("ports")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InternalError(f"malformed sandbox in answer: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class SecretInfo:
    """A secret's metadata (``GET /v1/secrets``); its value is never sent back.

    Sandboxes bound to it hold a placeholder in environment variable ``env``; the
    gateway sends the value, in place of the placeholder (``injection`` "placeholder")
    or as header ``header`` written ``format`` ("header"), only to ``hosts``.
    ``key_id`` names the master key that wraps it at rest.
    """

    name: str
    hosts: tuple[str, ...]
    env: str
    injection: str
    header: str | None
    format: str
    created_at: datetime
    updated_at: datetime
    key_id: str

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> SecretInfo:
        """Parse a Secret object; raises InternalError if it is malformed."""
        try:
            return cls(
                name=_required_str(body, "name"),
                hosts=tuple(str(host) for host in body["hosts"]),
                env=_required_str(body, "env"),
                injection=_required_str(body, "injection"),
                header=_optional_str(body, "header"),
                format=_required_str(body, "format"),
                created_at=_required_time(body, "created_at"),
                updated_at=_required_time(body, "updated_at"),
                key_id=_required_str(body, "key_id"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InternalError(f"malformed secret in answer: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """A snapshot: a restorable copy of a sandbox's disk and memory (``GET /v1/snapshots``).

    ``parent_id`` is the snapshot the sandbox had last come from or taken when this one
    was taken, so a tenant's snapshots form a forest. ``template``, ``cpus``,
    ``memory_mib`` and ``disk_mib`` are those of the sandbox it was taken of (a sandbox
    created from it gets them). ``memory_bytes`` is the saved memory;
    ``exclusive_bytes`` the disk bytes only this snapshot holds (what deleting it
    frees), None when the node did not measure it. ``archived``: the platform's
    artifact store holds it, so it restores on any node.
    """

    snapshot_id: str
    name: str
    sandbox_id: str
    parent_id: str | None
    node_id: str | None
    created_at: datetime
    template: str
    cpus: int
    memory_mib: int
    disk_mib: int
    memory_bytes: int
    exclusive_bytes: int | None
    archived: bool = False

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> SnapshotInfo:
        """Parse a Snapshot object; raises InternalError if it is malformed."""
        try:
            return cls(
                snapshot_id=_required_str(body, "id"),
                name=_required_str(body, "name"),
                sandbox_id=_required_str(body, "sandbox_id"),
                parent_id=_optional_str(body, "parent_id"),
                node_id=_optional_str(body, "node_id"),
                created_at=_required_time(body, "created_at"),
                template=_required_str(body, "template"),
                cpus=_required_int(body, "cpus"),
                memory_mib=_required_int(body, "memory_mib"),
                disk_mib=_required_int(body, "disk_mib"),
                memory_bytes=_required_int(body, "memory_bytes"),
                exclusive_bytes=_optional_int(body, "exclusive_bytes"),
                archived=body.get("archived") is True,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InternalError(f"malformed snapshot in answer: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """One node's warm pool of one template (``GET /v1/pools``).

    A warm pool holds VMs already woken from the template's ready state and paused; a
    create of that template and shape takes one instead of booting. ``size`` VMs wait
    now and the pool fills towards ``target`` (recent demand, clamped to
    ``min_size``..``max_size``). ``hits`` counts the creates it served, ``misses`` the
    creates of its shape it could not serve; ``hit_rate`` is hits / (hits + misses),
    None while both are 0.
    """

    node_id: str
    template: str
    size: int
    target: int
    min_size: int
    max_size: int
    hits: int
    misses: int
    hit_rate: float | None

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> PoolInfo:
        """Parse a Pool object; raises InternalError if it is malformed."""
        try:
            return cls(
                node_id=_required_str(body, "node_id"),
                template=_required_str(body, "template"),
                size=_required_int(body, "size"),
                target=_required_int(body, "target"),
                min_size=_required_int(body, "min_size"),
                max_size=_required_int(body, "max_size"),
                hits=_required_int(body, "hits"),
                misses=_required_int(body, "misses"),
                hit_rate=_optional_fraction(body, "hit_rate"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InternalError(f"malformed pool in answer: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class TemplateInfo:
    """One tag of a template (``GET /v1/templates``): what its sandboxes start with.

    A sandbox names it as ``ref`` (``name:tag``), as ``name`` for the tag ``latest``, or
    as ``name@digest`` for exactly this build. ``base`` is what it was built on
    (``debian:<release>``, ``template:<name>:<tag>`` or ``template@<digest>``);
    ``cpus``, ``memory_mib`` and ``disk_mib`` are its sandboxes' defaults, and ``ready``
    says whether sandboxes of exactly that shape start from a saved, booted state.
    """

    name: str
    tag: str
    digest: str
    created_at: datetime
    base: str
    cpus: int
    memory_mib: int
    disk_mib: int
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    start: str | None = None
    ready: bool = False

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> TemplateInfo:
        """Parse a Template object; raises InternalError if it is malformed."""
        try:
            return cls(
                name=_required_str(body, "name"),
                tag=_required_str(body, "tag"),
                digest=_required_str(body, "digest"),
                created_at=_required_time(body, "created_at"),
                base=_required_str(body, "base"),
                cpus=_required_int(body, "cpus"),
                memory_mib=_required_int(body, "memory_mib"),
                disk_mib=_required_int(body, "disk_mib"),
                env={str(k): str(v) for k, v in dict(body.get("env") or {}).items()},
                workdir=_optional_str(body, "workdir"),
                start=_optional_str(body, "start"),
                ready=bool(body.get("ready", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InternalError(f"malformed template in answer: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class EgressEvent:
    """One decision of a sandbox's egress gateway (``GET .../egress/log``).

    ``protocol`` is ``dns``, ``tcp``, ``tls`` or ``http``; ``host`` the name the sandbox
    asked for (DNS name, SNI or Host), ``address``/``port`` where the gateway connected
    (or would have). ``decision`` is ``allow`` or ``deny`` and ``reason`` says why in a
    few words; ``drop`` (protocol ``audit``) is the audit's note of events it dropped.
    ``bytes_out``/``bytes_in`` count the connection's traffic; ``secrets`` names the
    secrets injected into the request (never their values).
    """

    time: datetime
    protocol: str
    host: str | None
    address: str | None
    port: int | None
    decision: str
    reason: str
    bytes_out: int = 0
    bytes_in: int = 0
    secrets: tuple[str, ...] = ()

    @property
    def allowed(self) -> bool:
        return self.decision == "allow"

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> EgressEvent:
        """Parse an EgressEvent object; raises InternalError if it is malformed."""
        try:
            return cls(
                time=_required_time(body, "time"),
                protocol=_required_str(body, "protocol"),
                host=_optional_str(body, "host"),
                address=_optional_str(body, "address"),
                port=_optional_int(body, "port"),
                decision=_required_str(body, "decision"),
                reason=_required_str(body, "reason"),
                bytes_out=_required_int(body, "bytes_out"),
                bytes_in=_required_int(body, "bytes_in"),
                secrets=tuple(_names(body["secrets"])),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InternalError(f"malformed egress event in answer: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class EgressLog(Sequence[EgressEvent]):
    """A read of a sandbox's egress decisions (``sandbox.network.log()``): a sequence of
    its latest events, oldest first, and ``dropped``, how many events the node's audit
    dropped over the sandbox's write budget (50/s, bursts of 200) since it began. Each
    drop is also noted in the log as an event with ``decision`` ``drop``."""

    events: tuple[EgressEvent, ...]
    dropped: int = 0

    @overload
    def __getitem__(self, index: int) -> EgressEvent: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[EgressEvent]: ...

    def __getitem__(self, index: int | slice) -> EgressEvent | Sequence[EgressEvent]:
        return self.events[index]

    def __len__(self) -> int:
        return len(self.events)


@dataclass(frozen=True, slots=True)
class CommandResult:
    """How a command ended and what it printed.

    ``stdout``/``stderr`` are decoded as UTF-8 (invalid bytes become U+FFFD) and hold at
    most the client's ``max_output_bytes`` each; ``output_truncated`` says whether more was
    produced (callbacks still saw all of it). ``exit_code`` is None when a ``signal``
    ended the process; ``timed_out`` means its ``timeout_s`` killed it.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None = None
    timed_out: bool = False
    output_truncated: bool = False

    @property
    def ok(self) -> bool:
        """True when the command exited with code 0 on its own."""
        return self.exit_code == 0 and self.signal is None and not self.timed_out


@dataclass(frozen=True, slots=True)
class PtySize:
    """A pseudo-terminal's window, 1 to 1000 rows and columns (E2B's ``PtySize``)."""

    rows: int = 24
    cols: int = 80


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A process started in a sandbox (``GET .../processes``)."""

    process_id: str
    pid: int
    argv: list[str] | None
    cmd: str | None
    running: bool
    exit_code: int | None
    signal: int | None
    #: The label it was started with, if any (``commands.connect(tag=...)`` finds it).
    tag: str | None = None
    #: Whether it runs on a pseudo-terminal.
    pty: bool = False

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> ProcessInfo:
        """Parse a Process object; raises InternalError if it is malformed."""
        try:
            argv = body.get("argv")
            return cls(
                process_id=str(body["process_id"]),
                pid=int(body["pid"]),
                argv=[str(a) for a in argv] if argv is not None else None,
                cmd=body.get("cmd"),
                running=bool(body.get("running", False)),
                exit_code=body.get("exit_code"),
                signal=body.get("signal"),
                tag=body.get("tag"),
                pty=bool(body.get("pty", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InternalError(f"malformed process in answer: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class FileInfo:
    """A file's metadata (the API's FileStat). ``mode`` holds the permission bits."""

    name: str
    path: str
    type: str
    size: int
    mode: int
    mtime: float
    owner: str

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> FileInfo:
        """Parse a FileStat object; raises InternalError if it is malformed."""
        try:
            return cls(
                name=str(body["name"]),
                path=str(body["path"]),
                type=str(body["type"]),
                size=int(body["size"]),
                mode=int(body["mode"]),
                mtime=float(body["mtime"]),
                owner=str(body.get("owner", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InternalError(f"malformed file stat in answer: {exc!r}") from None


def _parse_time(value: object) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, tz=UTC)
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def _required_time(body: Mapping[str, Any], key: str) -> datetime:
    value = _parse_time(_required_str(body, key))
    if value is None or value.tzinfo is None:
        raise ValueError(f"{key} is not an ISO 8601 time with a zone")
    return value


def _required_str(body: Mapping[str, Any], key: str) -> str:
    value = body[key]
    if not isinstance(value, str) or not value:
        raise TypeError(f"{key} is not a non-empty string: {value!r}")
    return value


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    return None if body.get(key) is None else _required_str(body, key)


def _required_int(body: Mapping[str, Any], key: str) -> int:
    value = body[key]
    # bool is an int subclass; true/false in a size field is as wrong as a string.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"{key} is not a non-negative integer: {value!r}")
    return value


def _optional_int(body: Mapping[str, Any], key: str) -> int | None:
    return None if body.get(key) is None else _required_int(body, key)


def _names(value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise TypeError(f"not a list of names: {value!r}")
    return value


def _optional_fraction(body: Mapping[str, Any], key: str) -> float | None:
    """``body[key]``: null, or a JSON number from 0 to 1 (KeyError if absent)."""
    value = body[key]
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 1:
        raise TypeError(f"{key} is not null or a number from 0 to 1: {value!r}")
    return float(value)
