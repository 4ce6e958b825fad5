"""What a node offers the control plane: the seam between the two layers.

The control plane holds a ``NodeService`` per node: in the embedded default it is the
in-process ``space.node.agent.Node``; for a node on another host it is
``space.node.http.client.RemoteNode``, which speaks the node's HTTP API. Both satisfy this
Protocol, so the control plane never knows which it has.
"""

from __future__ import annotations

import enum
import re
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from space.node.api.errors import InvalidArgument

__all__ = [
    "EGRESS_DECISIONS",
    "GUEST_CHOICES",
    "GUEST_TYPES",
    "MAX_METRICS_SAMPLES",
    "MAX_TUNNEL_CHUNK_BYTES",
    "METRICS_INTERVAL_S",
    "TENANT_PREFIX",
    "BuildEvent",
    "BuildFailed",
    "BuildLog",
    "BuildStream",
    "BuildSucceeded",
    "CapacityInfo",
    "EgressEvent",
    "EgressLog",
    "ExecEvent",
    "ExecExited",
    "ExecOutput",
    "ExecRequest",
    "ExecStream",
    "ExportTicket",
    "FileReader",
    "FileStat",
    "ImportResult",
    "NodeInfo",
    "NodeService",
    "PoolInfo",
    "PortTunnel",
    "ProcessInfo",
    "PtySize",
    "SandboxMetrics",
    "SandboxSpec",
    "SandboxState",
    "SandboxStatus",
    "SecretGrant",
    "SnapshotInfo",
    "TemplateImport",
    "TemplateInfo",
    "TemplateTicket",
    "WatchEvent",
    "WatchStream",
    "snapshot_archive",
]


class SandboxState(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    #: vCPUs stopped, memory kept; resumed by ``resume_sandbox`` or any guest operation.
    PAUSED = "paused"
    #: Memory and device state saved in the sandbox's own volume, no VMM, no RAM held;
    #: resumed by ``resume_sandbox`` or any guest operation, processes carrying on.
    HIBERNATED = "hibernated"
    STOPPED = "stopped"
    ERROR = "error"
    DELETED = "deleted"
    #: The control plane's word, never a node's: the sandbox's node stopped
    #: heartbeating (issue 19). It comes back as it was if the node does; until then
    #: only delete is accepted.
    LOST = "lost"


#: The guest types a sandbox may run as (issue 21): a QEMU VM with its own kernel, or
#: gVisor's application kernel (runsc) on the host's kernel.
GUEST_TYPES = ("qemu", "gvisor")
#: What a spec may ask for: a type, or ``auto`` (the node's choice).
GUEST_CHOICES = (*GUEST_TYPES, "auto")


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    sandbox_id: str
    template: str = "base"
    cpus: int = 1
    memory_mib: int = 256
    disk_mib: int = 2048
    #: Environment every exec in this sandbox starts with (request env overrides it).
    env: dict[str, str] = field(default_factory=dict)
    #: Start from this snapshot (its disk and memory, processes running) instead of
    #: booting the template. template, cpus, memory_mib and disk_mib must equal the
    #: snapshot's (``SnapshotInfo``); the new sandbox gets a fresh identity.
    from_snapshot: str | None = None
    #: Egress policy as JSON (space.node.api.egress_policy.EgressPolicy.parse); None or no
    #: rules means no network at all, DNS included.
    egress: dict[str, object] | None = None
    #: The guest type (GUEST_CHOICES): ``qemu`` (a VM with its own kernel), ``gvisor``
    #: (gVisor's application kernel) or ``auto`` (the node's choice, NodeConfig.guest).
    guest: str = "auto"


@dataclass(frozen=True, slots=True)
class SandboxStatus:
    sandbox_id: str
    state: SandboxState
    template: str
    cpus: int
    memory_mib: int
    disk_mib: int
    created_at: float
    #: Process id of the VMM on the node, while it runs.
    vmm_pid: int | None = None
    error: str | None = None
    #: The snapshot this sandbox last came from or took (its parent in the snapshot tree).
    head_snapshot: str | None = None
    #: The artifact store's bundle holding the sandbox as it is now, if any (issue 19):
    #: it can be restored from there on another node.
    archive: str | None = None
    #: The guest type it runs (GUEST_TYPES), ``auto`` resolved.
    guest: str = "qemu"


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """A read-only, restorable copy of a sandbox's disk and memory, taken while paused.

    Listed only once every part of it is durably written. ``parent_id`` is the snapshot
    the sandbox had last come from or taken when this one was taken: the snapshot tree.
    """

    snapshot_id: str
    #: The sandbox it was taken of (which may since have been deleted).
    sandbox_id: str
    parent_id: str | None
    created_at: float
    template: str
    cpus: int
    memory_mib: int
    disk_mib: int
    #: Bytes of saved memory: device state plus the guest RAM pages written to disk.
    memory_bytes: int
    #: Disk bytes only this snapshot holds (freed by deleting it); None if not measured.
    exclusive_bytes: int | None = None
    #: The guest type of the sandbox it was taken of: only a sandbox of that type can
    #: run it (a QEMU memory image means nothing to runsc, and the other way round).
    guest: str = "qemu"


@dataclass(frozen=True, slots=True)
class PtySize:
    """A pseudo-terminal's window: 1 to 1000 rows and columns (space.protocol.MAX_PTY_SIZE)."""

    rows: int = 24
    cols: int = 80


@dataclass(frozen=True, slots=True)
class ExecRequest:
    argv: list[str] | None = None
    cmd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: str = "user"
    timeout_s: float | None = None
    background: bool = False
    #: Stdin, sent whole then closed; None means stdin is /dev/null (unless open_stdin).
    stdin: bytes | None = None
    #: Keep stdin open for ``write_stdin`` (in pieces, then EOF) until the process ends
    #: (issue 20); excludes ``stdin``.
    open_stdin: bool = False
    #: Run on a pseudo-terminal of this size: stdout and stderr are one stream
    #: ("stdout"), input goes through ``write_stdin`` (0x03 is Ctrl-C), ``resize_pty``
    #: changes the size. Excludes ``stdin``.
    pty: PtySize | None = None
    #: A label to find the process by in ``list_processes`` (space.protocol.TAG_PATTERN).
    tag: str | None = None
    #: With ``background``: the returned stream carries the process's output and end,
    #: as ``attach`` would, in the same guest request (one round trip, not exec then
    #: attach); closing it detaches, the process runs on (issue 20, E2B's Start).
    follow: bool = False


@dataclass(frozen=True, slots=True)
class ProcessSelector:
    """A running background process named by its pid or its tag, not its process id
    (E2B's ProcessSelector): ``attach`` finds and follows it in one guest request
    (issue 20, E2B's Connect). Exactly one of the two; an ended process is not found;
    of several running with one tag, the oldest is chosen."""

    pid: int | None = None
    tag: str | None = None

    def __post_init__(self) -> None:
        if (self.pid is None) == (self.tag is None):
            raise InvalidArgument("select a process by pid or by tag, not both or neither")


@dataclass(frozen=True, slots=True)
class ExecOutput:
    stream: Literal["stdout", "stderr"]
    data: bytes


@dataclass(frozen=True, slots=True)
class ExecExited:
    exit_code: int | None
    signal: int | None
    timed_out: bool = False


ExecEvent = ExecOutput | ExecExited


@dataclass(frozen=True, slots=True)
class EgressEvent:
    """One decision of the node's egress gateway for a sandbox: a connection, an HTTP
    request on it, or a DNS query. Secrets appear by name only, never by value."""

    time: float
    #: "dns", "tcp", "tls" or "http".
    protocol: str
    #: The name the sandbox asked for (DNS name, SNI or Host), if any.
    host: str | None
    #: The address the gateway connected to (or would have), if it got that far.
    address: str | None
    port: int | None
    #: "allow" or "deny"; "drop" for the audit's own event (protocol "audit") saying how
    #: many events it dropped over the sandbox's write budget (issue 17).
    decision: str
    #: Why, in a few words ("policy", "no rule for host", "blocked address: metadata").
    reason: str
    bytes_out: int = 0
    bytes_in: int = 0
    #: Names of the secrets injected into this request.
    secrets: tuple[str, ...] = ()


#: The decisions the egress gateway makes about a guest's traffic (EgressEvent.decision;
#: its audit also writes ``drop`` events of its own, which decide nothing).
EGRESS_DECISIONS = ("allow", "deny")


@dataclass(frozen=True, slots=True)
class EgressLog:
    """A read of a sandbox's egress audit: its latest events, oldest first, and how many
    events its audit has dropped over its write budget since the sandbox began."""

    events: list[EgressEvent]
    dropped: int = 0


@dataclass(frozen=True, slots=True)
class SecretGrant:
    """One secret a sandbox may use, as the egress gateway applies it. The value never
    enters the guest, the node's disk or a log: the guest holds ``placeholder`` (in
    its environment as ``env``), and the gateway puts ``value`` in its place only on
    requests to a host matching one of ``hosts`` (domain patterns, as in egress rules).

    ``injection`` "placeholder": every occurrence of the placeholder in the request's
    header values and URL is replaced. "header": header ``header`` is set to
    ``format`` with ``{value}`` replaced, on every request to those hosts.
    """

    name: str
    value: str
    placeholder: str
    hosts: tuple[str, ...]
    env: str | None = None
    injection: Literal["placeholder", "header"] = "placeholder"
    header: str | None = None
    format: str = "{value}"

    def __repr__(self) -> str:  # never the value, wherever a grant is printed
        return (
            f"SecretGrant(name={self.name!r}, hosts={self.hosts!r}, injection={self.injection!r})"
        )


class ExecStream(Protocol):
    """A started process: ``pid``, ``process_id`` and whether it runs on a terminal
    (``pty``: its output is all "stdout") are known, output follows.

    Iterating yields ExecOutput events as produced and ends after one ExecExited (a
    background exec yields nothing, unless it ``follow``s). ``aclose`` abandons the
    stream: a foreground process is killed, a background one keeps running.
    """

    pid: int
    process_id: str
    pty: bool

    def __aiter__(self) -> AsyncIterator[ExecEvent]: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class FileStat:
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float
    owner: str


class FileReader(Protocol):
    """An opened guest file: ``stat`` is known, the bytes follow in chunks."""

    stat: FileStat

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


WatchEventType = Literal["create", "write", "remove", "rename", "chmod", "dropped"]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change in a watched directory (issue 20), or ``dropped``: ``count`` changes
    lost because the watcher fell behind. ``path`` is absolute in the guest, ``name``
    relative to the watched directory; ``rename`` is the old name (the new one comes as
    ``create``)."""

    type: WatchEventType
    path: str = ""
    name: str = ""
    is_dir: bool = False
    count: int = 0


class WatchStream(Protocol):
    """A directory being watched: ``path`` (resolved) is watched, events follow.

    Iterating yields WatchEvents as they happen and ends when the directory itself is
    removed. ``aclose`` stops the watch and releases it in the guest.
    """

    path: str

    def __aiter__(self) -> AsyncIterator[WatchEvent]: ...

    async def aclose(self) -> None: ...


class PortTunnel(Protocol):
    """A TCP connection to a server listening in a sandbox, on ``port`` (issue 20).

    ``read`` returns the next bytes the server sent (at most MAX_TUNNEL_CHUNK_BYTES),
    b"" once it closed its side; ``write`` returns once the bytes are on their way within
    the guest's credit (it waits while the server does not read); ``close_write`` sends
    EOF (the server reads its end). ``aclose`` closes the connection in the guest,
    whatever is still in flight (idempotent). Both raise space.node.api errors.
    """

    port: int

    async def read(self) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def close_write(self) -> None: ...

    async def aclose(self) -> None: ...


#: Most bytes one PortTunnel.read returns: one DATA frame of the guest channel.
MAX_TUNNEL_CHUNK_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    process_id: str
    pid: int
    argv: list[str] | None
    cmd: str | None
    running: bool
    exit_code: int | None
    signal: int | None
    started_at: float
    tag: str | None = None
    pty: bool = False


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """A node's warm pool of one template: VMs woken from its ready state, paused."""

    template: str
    #: Paused VMs waiting now, and how many the pool is filling towards.
    size: int
    target: int
    min_size: int
    max_size: int
    #: Creates served from the pool, and creates of the ready shape it could not serve.
    hits: int
    misses: int


@dataclass(frozen=True, slots=True)
class CapacityInfo:
    """What a node's admission decides from, now (space/node/core/capacity.py has the
    formula). Memory and pool figures in MiB."""

    memory_total_mib: int
    #: MemAvailable, and what starts in flight hold of it (not yet visible in it).
    memory_available_mib: int
    memory_starting_mib: int
    memory_reserve_mib: int
    #: What the live VMs may grow to (guest RAM plus QEMU overhead, summed), and its
    #: limit: the overcommit ratio times (total - reserve).
    memory_committed_mib: int
    memory_commit_limit_mib: int
    pool_total_mib: int
    pool_free_mib: int
    #: Room kept in the pool to save the RAM of every VM holding memory.
    pool_kept_mib: int
    pool_reserve_mib: int
    #: VMs starting now (admitted, not yet running).
    starting: int
    #: The operator's cap on sandboxes, if any.
    max_sandboxes: int | None
    #: How many more sandboxes of the default shape the node would admit now.
    room: int


#: How a tenant's template names begin on a node: ``t`` + 16 hex digits + ``.`` (the
#: control plane names them so, space.control.template_names). The node tells a build's
#: owner by it; the control plane takes it out of what a tenant sees.
TENANT_PREFIX = re.compile(r"t[0-9a-f]{16}\.")


@dataclass(frozen=True, slots=True)
class TemplateInfo:
    """One tag of a template on a node: what sandboxes created from it start with.

    ``name`` is ``base`` for the node's built-in template (never built from a spec). A
    sandbox names a template as ``name`` (tag ``latest``), ``name:tag`` or
    ``name@digest``; its cpus, memory_mib and disk_mib are the defaults of such
    sandboxes, and sandboxes of exactly that shape start from the ready state.
    """

    name: str
    tag: str
    #: The content digest of the build (its last step's), 64 lowercase hex digits.
    digest: str
    created_at: float
    #: The spec's ``base``: ``debian:<release>``, ``template:<name>:<tag>`` or
    #: ``template@<digest>`` (``debian:<release>`` for ``base`` itself).
    base: str
    cpus: int
    memory_mib: int
    disk_mib: int
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    start: str | None = None
    #: Whether its ready state (booted, start command running, memory saved) exists.
    ready: bool = False


@dataclass(frozen=True, slots=True)
class BuildLog:
    """One line of a template build's log: a step starting, cached, or its output."""

    line: str


@dataclass(frozen=True, slots=True)
class BuildSucceeded:
    template: TemplateInfo


@dataclass(frozen=True, slots=True)
class BuildFailed:
    """The build stopped: the previous version of the template (if any) is unchanged."""

    #: The stable error code (``build_failed`` for a failing step, else a NodeError code).
    code: str
    message: str
    #: The position (from 0) of the failing step in the plan, if a step failed.
    step: int | None = None


BuildEvent = BuildLog | BuildSucceeded | BuildFailed


class BuildStream(Protocol):
    """A running build: log lines as they come, then one BuildSucceeded or BuildFailed.

    ``aclose`` stops listening; the build itself carries on to its end on the node.
    """

    build_id: str

    def __aiter__(self) -> AsyncIterator[BuildEvent]: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ExportTicket:
    """A hibernated sandbox offered for a move (issue 19), from ``export_sandbox`` on
    its node (the source), for ``import_sandbox`` on the target.

    ``ticket`` is the one credential the target presents to the source to read the
    stream (never the source's node token); it expires at ``expires_at`` (Unix time) or
    when the source's ``finish_export`` runs. ``record`` is the sandbox's node record
    (spec, template, its env and workdir; space.node.core.state). ``parents`` name the
    read-only subvolumes the stream may be incremental against, by the UUID a send
    stream names them with; a target that holds one of them gets only what differs.
    ``key_id`` fingerprints the node key the sandbox's disk and saved memory are sealed
    with: only a node with that key can wake it. ``max_stream_bytes`` bounds what the
    target accepts.
    """

    sandbox_id: str
    ticket: str = field(repr=False)
    expires_at: float
    record: dict[str, object]
    parents: list[str]
    key_id: str
    max_stream_bytes: int


@dataclass(frozen=True, slots=True)
class ImportResult:
    """A sandbox moved in by ``import_sandbox``: its status here (HIBERNATED), the
    bytes of the stream that came, and the parent it was incremental against (None:
    a full stream)."""

    status: SandboxStatus
    stream_bytes: int
    parent: str | None


@dataclass(frozen=True, slots=True)
class TemplateTicket:
    """A built template offered to another node (issue 19: a template is built once and
    shipped), from ``export_template`` on a node that holds it (the source), for
    ``import_template`` on the target.

    ``ticket`` is the credential the target presents to the source's
    ``stream_template`` (never the node token); it expires at ``expires_at`` (Unix
    time). ``record`` is the build's catalog record on the source (digest, base,
    created_at, shape, env, workdir, start) and ``tags`` the tags naming it there.
    ``parents`` name, nearest first, the read-only template subvolumes the stream may
    be incremental against (by the UUID a send stream names them with). ``key_id``
    fingerprints the node key its disk is sealed with; ``max_stream_bytes`` bounds
    what the target accepts.
    """

    name: str
    digest: str
    tags: list[str]
    ticket: str = field(repr=False)
    expires_at: float
    record: dict[str, object]
    parents: list[str]
    key_id: str
    max_stream_bytes: int


@dataclass(frozen=True, slots=True)
class TemplateImport:
    """A template shipped in by ``import_template``: it as the target lists it, the
    bytes of the stream that came (0: it was here already) and the parent the stream
    was incremental against (None: a full stream, or none)."""

    template: TemplateInfo
    stream_bytes: int
    parent: str | None


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    accelerator: Literal["kvm", "tcg"]
    templates: list[str]
    sandboxes: int
    pools: list[PoolInfo] = field(default_factory=list)
    #: Changes each time the node agent starts: what it holds in memory only (secret
    #: grants) must be sent again.
    boot_id: str = ""
    #: The node's capacity figures (None from a node that does not report them).
    capacity: CapacityInfo | None = None
    #: Whether the node keeps snapshots and hibernated sandboxes in an artifact store.
    archives: bool = False
    #: The egress gateway's decisions since it started, by kind (``allow``, ``deny``;
    #: back to 0 when the gateway restarts), for the platform's Prometheus counters.
    egress_decisions: dict[str, int] = field(default_factory=dict)
    #: The guest types this node runs (GUEST_TYPES; ``runsc`` installed for gvisor).
    guest_types: list[str] = field(default_factory=lambda: ["qemu"])


#: Most samples a node keeps per sandbox for ``sandbox_metrics``: with one new sample
#: at most every METRICS_INTERVAL_S, ten minutes of a sandbox polled without pause.
MAX_METRICS_SAMPLES = 120
#: A request for metrics within this many seconds of the last sample answers the
#: samples kept without asking the guest again (a dashboard polling every second
#: wakes a guest every 5 s, as E2B samples, not every time).
METRICS_INTERVAL_S = 5.0


@dataclass(frozen=True, slots=True)
class SandboxMetrics:
    """One sample of a sandbox's resource use, measured by spaced in the guest and
    checked by the node (space.protocol.Metrics has the meaning and the bounds).
    ``timestamp`` is the node's clock (Unix seconds) when the guest answered."""

    timestamp: float
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    disk_used: int
    disk_total: int


def snapshot_archive(snapshot_id: str) -> str:
    """The artifact store's bundle of a snapshot (the node makes it, the control plane
    has it deleted with the snapshot)."""
    return f"snapshots/{snapshot_id}"


class NodeService(Protocol):
    """Operations on one node. Every method raises space.node.api.errors.NodeError leaves.

    create and delete are idempotent per sandbox id; create returns once the guest
    daemon answered its hello (state RUNNING). pause, hibernate and resume are
    idempotent too (pausing a PAUSED sandbox returns its status; resume accepts PAUSED
    and HIBERNATED) and raise Conflict, naming the state, where the state does not
    allow them. Every guest operation (exec, attach, processes, files) on a PAUSED or
    HIBERNATED sandbox resumes it first.

    snapshot_sandbox is idempotent per snapshot id and accepts RUNNING, PAUSED and
    HIBERNATED sandboxes (each keeps its state). restore_sandbox rolls a sandbox back
    in place (disk, memory, processes) and leaves it RUNNING. fork_sandbox makes one new
    RUNNING sandbox per child id from a live (or paused, or hibernated) sandbox, which
    keeps its state after a brief pause. Every restore and fork gives the guest a fresh
    identity: hostname, machine-id, reseeded RNG, new session, clock set to the host's.
    A sandbox may be restored to, or created from, any snapshot on the node whose
    template, cpus, memory_mib and disk_mib equal its own (InvalidArgument otherwise);
    the control plane restricts that to the tenant's own snapshots. get_snapshot and
    list_snapshots measure ``exclusive_bytes``; delete_snapshot is idempotent (children
    in the tree are re-parented to its parent). Unknown ids raise NotFound.

    build_template reads a build context: a tar stream (plain or gzip) holding the spec
    as ``space.toml`` at its root and the files its copy steps name, only regular files
    and directories (space.node.templates.context has the limits). A bad archive or spec
    raises InvalidArgument (TemplateSpecError, with the key path) before any event, and
    so does ResourceExhausted when the template's tenant has as many builds waiting for
    a build slot on the node as may wait (the context is removed then); the build then
    waits for its slot and runs on the node, its log streamed, and ends with
    BuildSucceeded (the tag now names the new build) or BuildFailed (the tag still names
    the previous build).
    Steps whose digest the node has built before are reused. list_templates lists every
    tag, ``base:latest`` included. delete_template takes ``name`` or ``name:tag`` (that
    tag) or ``name@digest`` (every tag of that build); sandboxes already created from it
    are unaffected. ``base`` cannot be deleted (Conflict); unknown refs raise NotFound.

    set_egress replaces a sandbox's egress policy (in any state but deleted); it takes
    effect for new connections and DNS queries within a second. A malformed policy
    raises InvalidArgument and leaves the old one. None means no network. egress_log
    returns the sandbox's most recent egress decisions, oldest first, at most ``limit``,
    and the count of decisions its audit dropped over the write budget.
    set_secrets replaces the secrets the sandbox's gateway may inject; the node keeps
    them in memory only (never on disk), so the control plane sends them again after
    a node restart (``info().boot_id`` changes). The placeholders are the guest's to
    see; they reach its environment through the spec's ``env``.

    write_stdin writes at most MAX_INPUT_BYTES (1 MiB) to the stdin (or terminal) of a
    process started with ``open_stdin`` or ``pty``, foreground or background, and closes
    it after if ``eof`` (a PTY gets Ctrl-D); it returns the bytes written, once the
    process took them (Timeout if it reads nothing for 30 s). Writes to one process are
    applied whole, in the order they reach the guest. NotFound for an unknown process,
    Conflict for one that has exited, has its stdin closed, or has none open (for
    resize_pty: has no PTY), InvalidArgument for too much data or a size out of range.

    open_port opens a TCP connection, inside the guest, to 127.0.0.1:``port`` (else
    ::1) and relays it (PortTunnel): never through the sandbox's network namespace, only
    through the guest channel. Unavailable (code ``connection_refused`` in the message)
    when nothing listens there, ResourceExhausted past the guest's 256 connections,
    InvalidArgument for a port outside 1 to 65535. A PAUSED or HIBERNATED sandbox is
    resumed first, as for every guest operation.

    watch_dir watches a guest directory (and, if ``recursive``, its subdirectories) and
    returns once the watch is in place; NotFound for a missing path, InvalidArgument for
    one that is not a directory, ResourceExhausted past the guest's bounds (64 watches,
    8,192 directories). Closing the stream releases the watch.

    Moves (issue 19) pull a hibernated sandbox from its node (the source) to another
    (the target): ``export_sandbox`` on the source (the sandbox HIBERNATED; Conflict
    otherwise) holds it still (no wake, restore or second export: Conflict) and
    answers an ExportTicket; ``import_sandbox(ticket, source_url)`` on the target reads
    the stream from the source's ``stream_export`` (which takes only the ticket),
    checks its SHA-256 before it accepts anything, and registers the sandbox
    HIBERNATED (a failure leaves nothing on the target); ``finish_export`` on the
    source then deletes its copy (``moved``) or lets it go on (not moved). Until that
    call the sandbox stays whole on the source, whatever failed. Egress policy rides
    with the record; secret grants do not (set them on the target).

    Archives (issue 19) keep snapshots and hibernated sandboxes in the node's artifact
    store (``info().archives``; Unavailable without one), restorable on any node with
    the same node key: ``archive_snapshot`` (idempotent) and ``fetch_snapshot`` (a copy
    here from the store, then listed like the node's own); ``archive_sandbox`` uploads
    a HIBERNATED sandbox and answers its status naming the bundle (``archive``, cleared
    by any change of state), ``import_archive`` registers it HIBERNATED on another node
    from that bundle, and ``delete_archive`` deletes a bundle (the node never deletes
    one of its own accord). Bundles are restorable only once complete (NotFound else).
    Template shipping (issue 19) is the same pull for a built template:
    ``export_template(ref)`` on a node holding the build answers a TemplateTicket
    (``base`` is every node's own: InvalidArgument); ``import_template(ticket,
    source_url)`` on another reads the source's ``stream_template`` (the ticket its
    credential), checks its SHA-256 and the files, makes the template's ready state
    here and then points the ticket's tags at it (each only if the build it names
    here is older). A failure leaves nothing; a build the node has already is
    answered at once (idempotent).
    """

    async def info(self) -> NodeInfo: ...

    async def sandbox_metrics(self, sandbox_id: str) -> list[SandboxMetrics]:
        """The samples the node keeps of a sandbox, oldest first (at most
        MAX_METRICS_SAMPLES). A RUNNING sandbox is sampled first unless its last sample
        is younger than METRICS_INTERVAL_S; a sandbox in any other state is never woken
        for it: the samples kept answer (none after a node restart or a move). NotFound
        for an unknown id; a guest that answers absurd values loses its channel
        (Unavailable), as for any malformed message."""
        ...

    async def create_sandbox(self, spec: SandboxSpec) -> SandboxStatus: ...

    async def delete_sandbox(self, sandbox_id: str) -> None: ...

    async def pause_sandbox(self, sandbox_id: str) -> SandboxStatus: ...

    async def resume_sandbox(self, sandbox_id: str) -> SandboxStatus: ...

    async def hibernate_sandbox(self, sandbox_id: str) -> SandboxStatus: ...

    async def snapshot_sandbox(self, sandbox_id: str, snapshot_id: str) -> SnapshotInfo: ...

    async def list_snapshots(self) -> list[SnapshotInfo]: ...

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo: ...

    async def delete_snapshot(self, snapshot_id: str) -> None: ...

    async def restore_sandbox(self, sandbox_id: str, snapshot_id: str) -> SandboxStatus: ...

    async def fork_sandbox(self, sandbox_id: str, child_ids: list[str]) -> list[SandboxStatus]: ...

    async def get_sandbox(self, sandbox_id: str) -> SandboxStatus: ...

    async def list_sandboxes(self) -> list[SandboxStatus]: ...

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecStream: ...

    async def attach(self, sandbox_id: str, process: str | ProcessSelector) -> ExecStream: ...

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]: ...

    async def kill_process(self, sandbox_id: str, process_id: str, signal: int = 9) -> None: ...

    async def write_stdin(
        self, sandbox_id: str, process_id: str, data: bytes, *, eof: bool = False
    ) -> int: ...

    async def resize_pty(self, sandbox_id: str, process_id: str, size: PtySize) -> None: ...

    async def watch_dir(
        self, sandbox_id: str, path: str, *, recursive: bool = False, user: str = "user"
    ) -> WatchStream: ...

    async def read_file(self, sandbox_id: str, path: str, user: str = "user") -> FileReader: ...

    async def open_port(self, sandbox_id: str, port: int) -> PortTunnel: ...

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: AsyncIterable[bytes],
        *,
        user: str = "user",
        mode: int = 0o644,
    ) -> FileStat: ...

    async def list_dir(self, sandbox_id: str, path: str, user: str = "user") -> list[FileStat]: ...

    async def stat(self, sandbox_id: str, path: str, user: str = "user") -> FileStat: ...

    async def make_dir(self, sandbox_id: str, path: str, user: str = "user") -> FileStat: ...

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None: ...

    async def rename(self, sandbox_id: str, src: str, dst: str, user: str = "user") -> FileStat: ...

    async def set_egress(self, sandbox_id: str, policy: dict[str, object] | None) -> None: ...

    async def egress_log(self, sandbox_id: str, *, limit: int = 100) -> EgressLog: ...

    async def set_secrets(self, sandbox_id: str, grants: list[SecretGrant]) -> None: ...

    async def export_sandbox(self, sandbox_id: str) -> ExportTicket: ...

    def stream_export(
        self, sandbox_id: str, ticket: str, parent: str | None
    ) -> AsyncIterator[bytes]: ...

    async def import_sandbox(self, ticket: ExportTicket, source_url: str) -> ImportResult: ...

    async def finish_export(self, sandbox_id: str, ticket: str, *, moved: bool) -> None: ...

    async def archive_snapshot(self, snapshot_id: str) -> None: ...

    async def fetch_snapshot(self, snapshot_id: str) -> SnapshotInfo: ...

    async def archive_sandbox(self, sandbox_id: str) -> SandboxStatus: ...

    async def import_archive(self, sandbox_id: str, archive: str) -> ImportResult: ...

    async def delete_archive(self, name: str) -> None: ...
    async def export_template(self, ref: str) -> TemplateTicket: ...

    def stream_template(
        self, digest: str, ticket: str, parent: str | None
    ) -> AsyncIterator[bytes]: ...

    async def import_template(self, ticket: TemplateTicket, source_url: str) -> TemplateImport: ...

    async def build_template(self, context: AsyncIterable[bytes]) -> BuildStream: ...

    async def list_templates(self) -> list[TemplateInfo]: ...

    async def delete_template(self, ref: str) -> None: ...
