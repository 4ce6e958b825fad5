"""Test doubles for the control plane: an in-memory NodeService and an app harness.

FakeNode keeps sandboxes, files and processes in dicts and emits scripted exec events;
it stands in for API behaviour only (real VMs are tested in tests/integration).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from fastapi import FastAPI

from space.control import ControlSettings, NodeRegistry, create_app, create_key
from space.node.api import (
    CapacityInfo,
    Conflict,
    ExecEvent,
    ExecExited,
    ExecOutput,
    ExecRequest,
    FileStat,
    InvalidArgument,
    NodeError,
    NodeInfo,
    NotFound,
    PermissionDenied,
    PoolInfo,
    ProcessInfo,
    ProcessSelector,
    SandboxMetrics,
    SandboxSpec,
    SandboxState,
    SandboxStatus,
    SecretGrant,
    SnapshotInfo,
    Unavailable,
    check_grants,
)
from tests.schema import at_newest_schema
from tests.unit._fake_archives import FakeArchives, FakeArchiveStore
from tests.unit._fake_egress import FakeEgress
from tests.unit._fake_moves import FakeMoves
from tests.unit._fake_ports import FakePorts
from tests.unit._fake_stdio import FakeStdio, FakeWatches
from tests.unit._fake_templates import FakeTemplates

CHUNK = 1024 * 1024
#: FakeNode methods that do not resume a paused or hibernated sandbox (guest operations do).
_LIFECYCLE = frozenset(
    {
        "get_sandbox",
        "pause_sandbox",
        "resume_sandbox",
        "hibernate_sandbox",
        "snapshot_sandbox",
        "restore_sandbox",
        "fork_sandbox",
        "set_egress",
        "egress_log",
        "set_secrets",
        "sandbox_metrics",
    }
)
_RUNNING, _PAUSED, _HIBERNATED = SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.HIBERNATED
#: The states each lifecycle method accepts, as the node's docstring says.
_ALLOWED = {
    "pause": {_RUNNING, _PAUSED},
    "resume": {_RUNNING, _PAUSED, _HIBERNATED},
    "hibernate": {_RUNNING, _PAUSED, _HIBERNATED},
    "snapshot": {_RUNNING, _PAUSED, _HIBERNATED},
    "restore": {_RUNNING, _PAUSED, _HIBERNATED},
    "fork": {_RUNNING, _PAUSED, _HIBERNATED},
}
_SHAPE = ("template", "cpus", "memory_mib", "disk_mib")


class FakeExecStream:
    def __init__(
        self, pid: int, process_id: str, events: list[ExecEvent | NodeError], pty: bool = False
    ) -> None:
        self.pid = pid
        self.process_id = process_id
        self.pty = pty
        self._events = events
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[ExecEvent]:
        for event in self._events:
            if isinstance(event, NodeError):
                raise event
            yield event

    async def aclose(self) -> None:
        self.closed = True


class FakeReader:
    def __init__(self, stat: FileStat, data: bytes) -> None:
        self.stat = stat
        self._data = data
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for offset in range(0, len(self._data), CHUNK):
            yield self._data[offset : offset + CHUNK]

    async def aclose(self) -> None:
        self.closed = True


def _script(request: ExecRequest) -> list[ExecEvent | NodeError]:
    """echo ARGS → stdout; fail-midway → some output, then Unavailable; cmd → stdout+stderr."""
    if request.background:
        return []
    if request.argv and request.argv[0] == "fail-midway":
        return [ExecOutput("stdout", b"partial"), Unavailable("channel broke")]
    if request.argv and request.argv[0] == "echo":
        out = (" ".join(request.argv[1:]) + "\n").encode()
    else:
        out = (request.cmd or "").encode() + (request.stdin or b"")
    return [ExecOutput("stdout", out), ExecOutput("stderr", b"err"), ExecExited(0, None)]


@dataclass
class _Box:
    status: SandboxStatus
    files: dict[str, bytes] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/"})
    processes: dict[str, tuple[ProcessInfo, list[ExecEvent | NodeError]]] = field(
        default_factory=dict
    )

    def copy(self, status: SandboxStatus) -> _Box:
        """A box with ``status`` and this box's files, dirs and processes."""
        return _Box(status, dict(self.files), set(self.dirs), dict(self.processes))


@dataclass
class _Snapshot:
    info: SnapshotInfo
    #: The sandbox's contents when taken (its status is not used).
    contents: _Box


class FakeNode(
    FakeTemplates, FakeEgress, FakeMoves, FakeArchives, FakeStdio, FakeWatches, FakePorts
):
    """An in-memory NodeService. ``calls`` records (method, sandbox_id) of every call.

    ``pools`` and ``capacity`` are what ``info`` reports as the node's warm pools and
    capacity figures (set them in a test); ``fail_create`` is raised by every create.
    Templates (build, list, delete) come from FakeTemplates; creating a sandbox from a
    template the node does not have is NotFound. Egress (set_egress, egress_log) comes
    from FakeEgress. ``grants`` holds each sandbox's secret grants as last set (checked
    as the node checks them), ``grant_pushes`` every set_secrets call in order; ``info``
    reports ``boot_id`` (change it to play a restarted node agent). ``scripts`` maps a
    command (``cmd``, or ``argv`` joined with spaces) to the events its exec yields (a
    background one yields them only to ``attach``, or when it ``follow``s); others
    follow ``_script``.
    """

    def __init__(self, node_id: str = "local", store: FakeArchiveStore | None = None) -> None:
        FakeTemplates.__init__(self)
        FakeEgress.__init__(self)
        FakeMoves.__init__(self)
        FakeArchives.__init__(self, store)
        FakeStdio.__init__(self)
        FakeWatches.__init__(self)
        FakePorts.__init__(self)
        self.node_id = node_id
        self.boxes: dict[str, _Box] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail_create: NodeError | None = None
        self.fail_next: NodeError | None = None
        self.upload_chunk_sizes: list[int] = []
        self.streams: list[FakeExecStream] = []
        self.snapshots: dict[str, _Snapshot] = {}
        self.pools: list[PoolInfo] = []
        self.capacity: CapacityInfo | None = None
        self.boot_id = "boot-1"
        self.grants: dict[str, list[SecretGrant]] = {}
        self.grant_pushes: list[tuple[str, list[SecretGrant]]] = []
        self.scripts: dict[str, list[ExecEvent | NodeError]] = {}
        #: Every request exec was given, in order.
        self.exec_requests: list[ExecRequest] = []
        #: What ``info`` reports as the egress gateway's decision counts.
        self.egress_decisions: dict[str, int] = {}
        #: Each sandbox's kept metrics samples, as the node's (sandbox_metrics).
        self.metrics: dict[str, list[SandboxMetrics]] = {}

    def _known(self, sandbox_id: str) -> bool:
        return sandbox_id in self.boxes

    def _box(self, method: str, sandbox_id: str) -> _Box:
        self.calls.append((method, sandbox_id))
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        box = self.boxes.get(sandbox_id)
        if box is None:
            raise NotFound(f"no sandbox {sandbox_id}", sandbox_id=sandbox_id)
        if box.status.state in (_PAUSED, _HIBERNATED) and method not in _LIFECYCLE:
            box.status = replace(box.status, state=_RUNNING, archive=None)  # as the node: resume
        return box

    def snapshot(self) -> object:
        """Everything observable, for "nothing changed" checks."""
        return {
            sid: (
                box.status,
                dict(box.files),
                set(box.dirs),
                {p: i for p, (i, _) in box.processes.items()},
            )
            for sid, box in self.boxes.items()
        } | {sn: snap.info for sn, snap in self.snapshots.items()}

    async def info(self) -> NodeInfo:
        return NodeInfo(
            self.node_id,
            "tcg",
            sorted({name for name, _tag in self.templates}),
            len(self.boxes),
            list(self.pools),
            self.boot_id,
            self.capacity,
            archives=self.archive_store is not None,
            egress_decisions=dict(self.egress_decisions),
        )

    async def sandbox_metrics(self, sandbox_id: str) -> list[SandboxMetrics]:
        """As the node: a RUNNING sandbox gets a new sample (of its own shape, 10 % of
        its CPU busy), any other state answers the samples kept, never waking it."""
        status = self._box("sandbox_metrics", sandbox_id).status
        samples = self.metrics.setdefault(sandbox_id, [])
        if status.state is _RUNNING:
            mib = 1024 * 1024
            samples.append(
                SandboxMetrics(
                    timestamp=time.time(),
                    cpu_count=status.cpus,
                    cpu_used_pct=10.0,
                    mem_used=status.memory_mib * mib // 4,
                    mem_total=status.memory_mib * mib,
                    disk_used=status.disk_mib * mib // 8,
                    disk_total=status.disk_mib * mib,
                )
            )
        return list(samples)

    async def set_secrets(self, sandbox_id: str, grants: list[SecretGrant]) -> None:
        self._box("set_secrets", sandbox_id)
        check_grants(grants)  # InvalidArgument, the old grants kept
        self.grants[sandbox_id] = list(grants)
        self.grant_pushes.append((sandbox_id, list(grants)))

    async def create_sandbox(self, spec: SandboxSpec) -> SandboxStatus:
        self.calls.append(("create_sandbox", spec.sandbox_id))
        if self.fail_create is not None:
            raise self.fail_create
        if spec.from_snapshot is None and not self.has_template(spec.template):
            raise NotFound(f"no template {spec.template}", sandbox_id=spec.sandbox_id)
        if spec.sandbox_id not in self.boxes:
            source = _Box(_status_of(spec))
            if spec.from_snapshot is not None:
                snap = self._snapshot(spec.from_snapshot)
                self._check_shape(snap.info, _status_of(spec))
                source = snap.contents
            status = replace(_status_of(spec), head_snapshot=spec.from_snapshot)
            self.boxes[spec.sandbox_id] = source.copy(status)
            self.egress[spec.sandbox_id] = spec.egress
        return self.boxes[spec.sandbox_id].status

    async def delete_sandbox(self, sandbox_id: str) -> None:
        self.calls.append(("delete_sandbox", sandbox_id))
        self.boxes.pop(sandbox_id, None)

    async def pause_sandbox(self, sandbox_id: str) -> SandboxStatus:
        return self._transition("pause", sandbox_id, _PAUSED)

    async def resume_sandbox(self, sandbox_id: str) -> SandboxStatus:
        return self._transition("resume", sandbox_id, _RUNNING)

    async def hibernate_sandbox(self, sandbox_id: str) -> SandboxStatus:
        return self._transition("hibernate", sandbox_id, _HIBERNATED)

    def _checked(self, operation: str, sandbox_id: str) -> _Box:
        """The box, if its state allows ``operation``; Conflict naming the state otherwise."""
        box = self._box(f"{operation}_sandbox", sandbox_id)
        if box.status.state not in _ALLOWED[operation]:
            raise Conflict(
                f"cannot {operation} sandbox {sandbox_id}: it is {box.status.state.value}",
                sandbox_id=sandbox_id,
            )
        return box

    def _transition(self, operation: str, sandbox_id: str, state: SandboxState) -> SandboxStatus:
        """As the real node: idempotent, Conflict naming any state it does not accept."""
        box = self._checked(operation, sandbox_id)
        if box.status.state != state:  # any change makes an archive stale, as on the node
            box.status = replace(box.status, state=state, archive=None)
        return box.status

    def _snapshot(self, snapshot_id: str) -> _Snapshot:
        snap = self.snapshots.get(snapshot_id)
        if snap is None:
            raise NotFound(f"no snapshot {snapshot_id}")
        return snap

    def _check_shape(self, info: SnapshotInfo, status: SandboxStatus) -> None:
        if any(getattr(info, f) != getattr(status, f) for f in _SHAPE):
            raise InvalidArgument(f"snapshot {info.snapshot_id} differs from the sandbox")

    def _measured(self, snap: _Snapshot) -> SnapshotInfo:
        size = 4096 + sum(len(data) for data in snap.contents.files.values())
        return replace(snap.info, exclusive_bytes=size)

    async def snapshot_sandbox(self, sandbox_id: str, snapshot_id: str) -> SnapshotInfo:
        box = self._checked("snapshot", sandbox_id)
        known = self.snapshots.get(snapshot_id)
        if known is not None:
            if known.info.sandbox_id != sandbox_id:
                raise Conflict(f"snapshot {snapshot_id} is of another sandbox")
            return known.info
        status = box.status
        info = SnapshotInfo(
            snapshot_id,
            sandbox_id,
            status.head_snapshot,
            time.time(),
            status.template,
            status.cpus,
            status.memory_mib,
            status.disk_mib,
            memory_bytes=status.memory_mib * 1024 * 1024 // 4,
        )
        self.snapshots[snapshot_id] = _Snapshot(info, box.copy(status))
        box.status = replace(status, head_snapshot=snapshot_id)
        return info

    async def list_snapshots(self) -> list[SnapshotInfo]:
        return [self._measured(snap) for snap in self.snapshots.values()]

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        self.calls.append(("get_snapshot", snapshot_id))
        return self._measured(self._snapshot(snapshot_id))

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Idempotent; children and heads are re-parented to the deleted one's parent."""
        self.calls.append(("delete_snapshot", snapshot_id))
        gone = self.snapshots.pop(snapshot_id, None)
        if gone is None:
            return
        parent = gone.info.parent_id
        for snap in self.snapshots.values():
            if snap.info.parent_id == snapshot_id:
                snap.info = replace(snap.info, parent_id=parent)
        for box in self.boxes.values():
            if box.status.head_snapshot == snapshot_id:
                box.status = replace(box.status, head_snapshot=parent)

    async def restore_sandbox(self, sandbox_id: str, snapshot_id: str) -> SandboxStatus:
        box = self._checked("restore", sandbox_id)
        snap = self._snapshot(snapshot_id)
        self._check_shape(snap.info, box.status)
        status = replace(box.status, state=_RUNNING, head_snapshot=snapshot_id, archive=None)
        self.boxes[sandbox_id] = snap.contents.copy(status)
        return status

    async def fork_sandbox(self, sandbox_id: str, child_ids: list[str]) -> list[SandboxStatus]:
        box = self._checked("fork", sandbox_id)
        taken = [child for child in child_ids if child in self.boxes]
        if taken:
            raise Conflict(f"sandboxes {taken} exist", sandbox_id=sandbox_id)
        for child in child_ids:
            status = replace(box.status, sandbox_id=child, state=_RUNNING, created_at=time.time())
            self.boxes[child] = box.copy(status)
            self.egress[child] = self.egress.get(sandbox_id)
        return [self.boxes[child].status for child in child_ids]

    async def get_sandbox(self, sandbox_id: str) -> SandboxStatus:
        return self._box("get_sandbox", sandbox_id).status

    async def list_sandboxes(self) -> list[SandboxStatus]:
        return [box.status for box in self.boxes.values()]

    async def exec(self, sandbox_id: str, request: ExecRequest) -> FakeExecStream:
        box = self._box("exec", sandbox_id)
        self.exec_requests.append(request)
        if request.follow and not request.background:
            raise InvalidArgument("follow needs background", sandbox_id=sandbox_id)
        if request.cwd is not None and request.cwd not in box.dirs:
            raise NotFound(f"no directory {request.cwd}", sandbox_id=sandbox_id)
        process_id = f"p{len(box.processes) + 1}"
        key = request.cmd if request.cmd is not None else " ".join(request.argv or [])
        events = self.scripts.get(key) or _script(request)
        info = ProcessInfo(
            process_id,
            100 + len(box.processes),
            request.argv,
            request.cmd,
            request.background,
            None if request.background else 0,
            None,
            time.time(),
            tag=request.tag,
            pty=request.pty is not None,
        )
        self._stdio_started(sandbox_id, process_id, request)
        box.processes[process_id] = (info, events)
        silent = request.background and not request.follow
        stream = FakeExecStream(info.pid, process_id, [] if silent else events, info.pty)
        self.streams.append(stream)
        return stream

    async def attach(self, sandbox_id: str, process: str | ProcessSelector) -> FakeExecStream:
        """By process id, or (as spaced) the oldest running process with a pid or tag."""
        box = self._box("attach", sandbox_id)
        if isinstance(process, str):
            process_id = process if process in box.processes else None
        else:
            process_id = next(
                (
                    info.process_id
                    for info, _ in box.processes.values()
                    if info.running
                    and (
                        info.pid == process.pid if process.tag is None else info.tag == process.tag
                    )
                ),
                None,
            )
        if process_id is None:
            raise NotFound(f"no process {process}", sandbox_id=sandbox_id)
        info, events = box.processes[process_id]
        if info.signal is not None:  # killed: its exit is the signal's
            events = [e for e in events if not isinstance(e, ExecExited)]
            events.append(ExecExited(None, info.signal))
        return FakeExecStream(info.pid, process_id, events, info.pty)

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]:
        return [info for info, _ in self._box("list_processes", sandbox_id).processes.values()]

    async def kill_process(self, sandbox_id: str, process_id: str, signal: int = 9) -> None:
        box = self._box("kill_process", sandbox_id)
        if process_id not in box.processes:
            raise NotFound(f"no process {process_id}", sandbox_id=sandbox_id)
        info, events = box.processes[process_id]
        killed = replace(info, running=False, exit_code=None, signal=signal)
        box.processes[process_id] = (killed, events)

    def _stat(self, box: _Box, path: str) -> FileStat:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if path in box.dirs:
            return FileStat(name, path, "dir", 0, 0o755, 1.0, "user")
        if path in box.files:
            return FileStat(name, path, "file", len(box.files[path]), 0o644, 1.0, "user")
        raise NotFound(f"no file {path}")

    async def read_file(self, sandbox_id: str, path: str, user: str = "user") -> FakeReader:
        box = self._box("read_file", sandbox_id)
        stat = self._stat(box, path)
        return FakeReader(stat, box.files.get(path, b""))

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: AsyncIterable[bytes],
        *,
        user: str = "user",
        mode: int = 0o644,
    ) -> FileStat:
        box = self._box("write_file", sandbox_id)
        if path.startswith("/readonly"):
            raise PermissionDenied(f"cannot write {path}")
        content = bytearray()
        async for chunk in data:
            self.upload_chunk_sizes.append(len(chunk))
            content += chunk
        box.files[path] = bytes(content)
        return self._stat(box, path)

    async def list_dir(self, sandbox_id: str, path: str, user: str = "user") -> list[FileStat]:
        box = self._box("list_dir", sandbox_id)
        prefix = path.rstrip("/") + "/"
        names = [p for p in [*box.files, *box.dirs] if p != path and p.startswith(prefix)]
        return [self._stat(box, p) for p in sorted(names) if "/" not in p[len(prefix) :]]

    async def stat(self, sandbox_id: str, path: str, user: str = "user") -> FileStat:
        return self._stat(self._box("stat", sandbox_id), path)

    async def make_dir(self, sandbox_id: str, path: str, user: str = "user") -> FileStat:
        box = self._box("make_dir", sandbox_id)
        if path in box.dirs or path in box.files:
            raise Conflict(f"{path} exists", sandbox_id=sandbox_id)
        box.dirs.add(path)
        return self._stat(box, path)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        box = self._box("remove", sandbox_id)
        self._stat(box, path)
        box.files.pop(path, None)
        box.dirs.discard(path)

    async def rename(self, sandbox_id: str, src: str, dst: str, user: str = "user") -> FileStat:
        box = self._box("rename", sandbox_id)
        if src not in box.files:
            raise NotFound(f"no file {src}", sandbox_id=sandbox_id)
        box.files[dst] = box.files.pop(src)
        return self._stat(box, dst)


def _status_of(spec: SandboxSpec) -> SandboxStatus:
    return SandboxStatus(
        spec.sandbox_id,
        _RUNNING,
        spec.template,
        spec.cpus,
        spec.memory_mib,
        spec.disk_mib,
        time.time(),
        vmm_pid=4242,
        guest="qemu" if spec.guest == "auto" else spec.guest,  # a node with KVM
    )


#: The database every control app of the running test uses ("": SQLite in its data
#: dir); the ``on_both_databases`` fixture (tests/unit/conftest.py) points it at a fresh
#: database of each backend in turn.
DATABASE_URL = ""


class FakeClock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    app: FastAPI
    client: httpx.AsyncClient
    settings: ControlSettings
    node: FakeNode
    clock: FakeClock

    def key(self, tenant: str) -> dict[str, str]:
        """Auth headers with a fresh key of ``tenant``."""
        return {"Authorization": f"Bearer {create_key(self.settings, tenant)}"}


@contextlib.asynccontextmanager
async def control_app(
    data_dir: Path,
    node: FakeNode | None = None,
    *,
    registry: NodeRegistry | None = None,
    reaper_interval_s: float = 3600.0,
    clock: FakeClock | None = None,
    egress_operator_ranges: tuple[str, ...] = (),
    sandbox_domain: str = "",
) -> AsyncIterator[Harness]:
    """The control plane over a FakeNode (as "local"), lifespan running, with a client,
    on the test's database (``DATABASE_URL``)."""
    node = node or FakeNode()
    clock = clock or FakeClock()
    settings = ControlSettings(
        data_dir=data_dir,
        database_url=DATABASE_URL,
        reaper_interval_s=reaper_interval_s,
        egress_operator_ranges=egress_operator_ranges,
        sandbox_domain=sandbox_domain,
    )
    at_newest_schema(settings.database_url)
    if registry is None:
        registry = NodeRegistry()
        registry.register("local", node)
    app = create_app(settings, registry, clock=clock)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://control") as client:
            yield Harness(app, client, settings, node, clock)


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
