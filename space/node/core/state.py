"""Persisted node state: one JSON file per sandbox and per snapshot, written atomically.

``data_dir/sandboxes/<id>.json`` is rewritten (temp file, fsync, rename, fsync of the
directory) before a transition is acknowledged, so a node that crashes at any point
finds on restart either the old or the new record, never a torn one. A multi-step
operation (hibernate, snapshot, restore, fork) first records itself as the sandbox's
``pending`` operation, so a restarted node knows what to finish or undo.

``data_dir/snapshots/<id>.json`` is written only once the snapshot's subvolume is
durable: that write publishes the snapshot.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

from space.node.api import SandboxSpec, SandboxState, SandboxStatus, SnapshotInfo

__all__ = ["Pending", "SandboxRecord", "SnapshotStore", "StateStore"]

R = TypeVar("R")

_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class SandboxRecord:
    """Everything a restarted node needs to re-adopt or clean up one sandbox."""

    spec: SandboxSpec
    state: SandboxState
    created_at: float
    template_digest: str
    run_dir: str
    vmm_pid: int | None = None
    error: str | None = None
    head_snapshot: str | None = None
    pending: Pending | None = None
    #: The template's env and workdir: every exec starts with them (spec env and the
    #: request override them), kept here because the template may be deleted later.
    template_env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    #: The name of the sandbox's subvolume under ``<pool>/sandboxes/`` ("" means the
    #: sandbox's id). Named once, when the volume is made, and never renamed while a VM
    #: may use it: QEMU reopens its disk by path when it saves state (issue 12), so a
    #: pool VM handed over keeps its volume's name and only the record changes.
    volume: str = ""
    #: The artifact store's bundle of this sandbox as it is now (issue 19;
    #: space.node.agent._archives): set once a hibernated sandbox's upload landed, and
    #: cleared by any change of state (``with_state``), which makes the bundle stale.
    archive: str | None = None
    #: The guest type it runs (GUEST_TYPES): the spec's choice with ``auto`` resolved
    #: by the node when it was created. Records from before issue 21 are QEMU's.
    guest: str = "qemu"

    def __post_init__(self) -> None:
        if not self.volume:
            object.__setattr__(self, "volume", self.spec.sandbox_id)

    @property
    def sandbox_id(self) -> str:
        return self.spec.sandbox_id

    def with_state(
        self, state: SandboxState, *, vmm_pid: int | None = None, error: str | None = None
    ) -> SandboxRecord:
        return replace(self, state=state, vmm_pid=vmm_pid, error=error, archive=None)

    def status(self) -> SandboxStatus:
        s = self.spec
        return SandboxStatus(
            sandbox_id=s.sandbox_id,
            state=self.state,
            template=s.template,
            cpus=s.cpus,
            memory_mib=s.memory_mib,
            disk_mib=s.disk_mib,
            created_at=self.created_at,
            vmm_pid=self.vmm_pid,
            error=self.error,
            head_snapshot=self.head_snapshot,
            archive=self.archive,
            guest=self.guest,
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = self.state.value
        data["version"] = _FORMAT_VERSION
        if self.pending is not None:
            data["pending"]["prior"] = self.pending.prior.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SandboxRecord:
        """Parse a record; raises ValueError (or KeyError/TypeError) if malformed."""
        if data.get("version") != _FORMAT_VERSION:
            raise ValueError(f"unknown state format version {data.get('version')!r}")
        spec = SandboxSpec(**data["spec"])
        pending = data.get("pending")
        return cls(
            spec=spec,
            state=SandboxState(data["state"]),
            created_at=float(data["created_at"]),
            template_digest=str(data["template_digest"]),
            run_dir=str(data["run_dir"]),
            vmm_pid=data.get("vmm_pid"),
            error=data.get("error"),
            head_snapshot=data.get("head_snapshot"),
            pending=None if pending is None else Pending.from_json(pending),
            template_env={str(k): str(v) for k, v in dict(data.get("template_env", {})).items()},
            workdir=data.get("workdir"),
            volume=str(data.get("volume") or ""),
            guest=str(data.get("guest") or "qemu"),
        )


@dataclass(frozen=True, slots=True)
class Pending:
    """A multi-step operation under way on a sandbox, recorded before its first step.

    ``op`` is one of: ``hibernate``, ``snapshot`` (``snapshot_id``), ``restore``
    (``snapshot_id``), ``capture`` (a fork reading this sandbox), ``fork`` (this sandbox
    is a child being made), ``identity`` (the VM runs from restored memory and still
    needs its fresh identity; ``fresh`` False means only the clock). ``prior`` is the
    state the sandbox had before.
    """

    op: str
    prior: SandboxState
    snapshot_id: str | None = None
    fresh: bool = True

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Pending:
        return cls(
            op=str(data["op"]),
            prior=SandboxState(data["prior"]),
            snapshot_id=data.get("snapshot_id"),
            fresh=bool(data.get("fresh", True)),
        )


class _JsonDir(Generic[R]):
    """A directory of one JSON record per id. Not safe for concurrent writers of one id."""

    def __init__(
        self,
        directory: Path,
        parse: Callable[[dict[str, Any]], R],
        dump: Callable[[R], dict[str, Any]],
        key: Callable[[R], str],
    ) -> None:
        self.directory = directory
        self._parse, self._dump, self._key = parse, dump, key
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, record_id: str) -> Path:
        return self.directory / f"{record_id}.json"

    def save(self, record: R) -> None:
        """Durably replace the record of its id."""
        path = self.path(self._key(record))
        tmp = path.with_name(f".{path.name}.tmp")
        payload = json.dumps(self._dump(record), indent=1, sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._fsync_dir()

    def get(self, record_id: str) -> R | None:
        """The record of ``record_id``, or None if there is none (or it is unreadable)."""
        try:
            return self._parse(json.loads(self.path(record_id).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def remove(self, record_id: str) -> None:
        """Delete the record; idempotent."""
        with contextlib.suppress(FileNotFoundError):
            self.path(record_id).unlink()
            self._fsync_dir()

    def load_all(self) -> tuple[list[R], list[Path]]:
        """Every readable record, and the paths of files that could not be parsed."""
        records, bad = [], []
        for path in sorted(self.directory.glob("*.json")):
            try:
                records.append(self._parse(json.loads(path.read_text())))
            except (OSError, ValueError, KeyError, TypeError):
                bad.append(path)
        return records, bad

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class StateStore(_JsonDir[SandboxRecord]):
    """The sandbox records of a node."""

    def __init__(self, directory: Path) -> None:
        super().__init__(
            directory, SandboxRecord.from_json, SandboxRecord.to_json, lambda r: r.sandbox_id
        )


def _snapshot_json(info: SnapshotInfo) -> dict[str, Any]:
    data = asdict(info)
    data.pop("exclusive_bytes")  # measured when asked, never stored
    data["version"] = _FORMAT_VERSION
    return data


def _snapshot_from_json(data: dict[str, Any]) -> SnapshotInfo:
    if data.pop("version", None) != _FORMAT_VERSION:
        raise ValueError("unknown snapshot format version")
    return SnapshotInfo(**data)


class SnapshotStore(_JsonDir[SnapshotInfo]):
    """The published snapshots of a node (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, _snapshot_from_json, _snapshot_json, lambda s: s.snapshot_id)
