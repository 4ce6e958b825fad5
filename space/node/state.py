"""Persisted per-sandbox state: one JSON file per sandbox, written atomically.

``data_dir/sandboxes/<id>.json`` is rewritten (temp file, fsync, rename, fsync of the
directory) before a transition is acknowledged, so a node that crashes at any point
finds on restart either the old or the new record, never a torn one.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from space.node.interface import SandboxSpec, SandboxState, SandboxStatus

__all__ = ["SandboxRecord", "StateStore"]

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

    @property
    def sandbox_id(self) -> str:
        return self.spec.sandbox_id

    def with_state(
        self, state: SandboxState, *, vmm_pid: int | None = None, error: str | None = None
    ) -> SandboxRecord:
        return replace(self, state=state, vmm_pid=vmm_pid, error=error)

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
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = self.state.value
        data["version"] = _FORMAT_VERSION
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SandboxRecord:
        """Parse a record; raises ValueError (or KeyError/TypeError) if malformed."""
        if data.get("version") != _FORMAT_VERSION:
            raise ValueError(f"unknown state format version {data.get('version')!r}")
        spec = SandboxSpec(**data["spec"])
        return cls(
            spec=spec,
            state=SandboxState(data["state"]),
            created_at=float(data["created_at"]),
            template_digest=str(data["template_digest"]),
            run_dir=str(data["run_dir"]),
            vmm_pid=data.get("vmm_pid"),
            error=data.get("error"),
        )


class StateStore:
    """The directory of sandbox records. Not safe for concurrent writers of one id."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, sandbox_id: str) -> Path:
        return self.directory / f"{sandbox_id}.json"

    def save(self, record: SandboxRecord) -> None:
        """Durably replace the record of ``record.sandbox_id``."""
        path = self.path(record.sandbox_id)
        tmp = path.with_name(f".{path.name}.tmp")
        payload = json.dumps(record.to_json(), indent=1, sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._fsync_dir()

    def remove(self, sandbox_id: str) -> None:
        """Delete the record; idempotent."""
        with contextlib.suppress(FileNotFoundError):
            self.path(sandbox_id).unlink()
            self._fsync_dir()

    def load_all(self) -> tuple[list[SandboxRecord], list[Path]]:
        """Every readable record, and the paths of files that could not be parsed."""
        records, bad = [], []
        for path in sorted(self.directory.glob("*.json")):
            try:
                records.append(SandboxRecord.from_json(json.loads(path.read_text())))
            except (OSError, ValueError, KeyError, TypeError):
                bad.append(path)
        return records, bad

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
