"""Value objects the SDK returns, parsed from the wire shapes in docs/api.md."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from space.sdk.errors import InternalError

__all__ = ["CommandResult", "FileInfo", "ProcessInfo", "SandboxInfo"]


@dataclass(frozen=True, slots=True)
class SandboxInfo:
    """One sandbox as the API reports it (``GET /v1/sandboxes/{id}``)."""

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
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InternalError(f"malformed sandbox in answer: {exc!r}") from None


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
class ProcessInfo:
    """A process started in a sandbox (``GET .../processes``)."""

    process_id: str
    pid: int
    argv: list[str] | None
    cmd: str | None
    running: bool
    exit_code: int | None
    signal: int | None

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
