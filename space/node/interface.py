"""What a node offers the control plane: the seam between the two layers.

The control plane holds a ``NodeService`` per node: in the embedded default it is the
in-process ``space.node.service.Node``; for a node on another host it is
``space.node.remote.RemoteNode``, which speaks the node's HTTP API. Both satisfy this
Protocol, so the control plane never knows which it has.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

__all__ = [
    "ExecEvent",
    "ExecExited",
    "ExecOutput",
    "ExecRequest",
    "ExecStream",
    "FileReader",
    "FileStat",
    "NodeInfo",
    "NodeService",
    "ProcessInfo",
    "SandboxSpec",
    "SandboxState",
    "SandboxStatus",
]


class SandboxState(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    #: vCPUs stopped, memory kept; resumed by ``resume_sandbox`` or any guest operation.
    PAUSED = "paused"
    STOPPED = "stopped"
    ERROR = "error"
    DELETED = "deleted"


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    sandbox_id: str
    template: str = "base"
    cpus: int = 1
    memory_mib: int = 256
    disk_mib: int = 2048
    #: Environment every exec in this sandbox starts with (request env overrides it).
    env: dict[str, str] = field(default_factory=dict)


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


@dataclass(frozen=True, slots=True)
class ExecRequest:
    argv: list[str] | None = None
    cmd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: str = "user"
    timeout_s: float | None = None
    background: bool = False
    #: Stdin, sent whole then closed; None means stdin is /dev/null.
    stdin: bytes | None = None


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


class ExecStream(Protocol):
    """A started process: ``pid`` and ``process_id`` are known, output follows.

    Iterating yields ExecOutput events as produced and ends after one ExecExited (a
    background exec yields nothing). ``aclose`` abandons the stream: a foreground process
    is killed, a background one keeps running.
    """

    pid: int
    process_id: str

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


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    accelerator: Literal["kvm", "tcg"]
    templates: list[str]
    sandboxes: int


class NodeService(Protocol):
    """Operations on one node. Every method raises space.node.errors.NodeError leaves.

    create and delete are idempotent per sandbox id; create returns once the guest
    daemon answered its hello (state RUNNING). pause and resume are idempotent too
    (pausing a PAUSED sandbox returns its status) and raise Conflict, naming the state,
    for a sandbox that is neither RUNNING nor PAUSED. Every guest operation (exec,
    attach, processes, files) on a PAUSED sandbox resumes it first.
    """

    async def info(self) -> NodeInfo: ...

    async def create_sandbox(self, spec: SandboxSpec) -> SandboxStatus: ...

    async def delete_sandbox(self, sandbox_id: str) -> None: ...

    async def pause_sandbox(self, sandbox_id: str) -> SandboxStatus: ...

    async def resume_sandbox(self, sandbox_id: str) -> SandboxStatus: ...

    async def get_sandbox(self, sandbox_id: str) -> SandboxStatus: ...

    async def list_sandboxes(self) -> list[SandboxStatus]: ...

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecStream: ...

    async def attach(self, sandbox_id: str, process_id: str) -> ExecStream: ...

    async def list_processes(self, sandbox_id: str) -> list[ProcessInfo]: ...

    async def kill_process(self, sandbox_id: str, process_id: str, signal: int = 9) -> None: ...

    async def read_file(self, sandbox_id: str, path: str, user: str = "user") -> FileReader: ...

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
