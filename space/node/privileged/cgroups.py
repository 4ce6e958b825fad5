"""One cgroup per VMM: a memory limit, a CPU quota, a pids limit and an I/O weight.

Both layouts work: cgroup v2 (one unified hierarchy, ``cgroup.controllers`` at its
root) and v1 (one hierarchy per controller, as on these machines: memory, cpu, pids and
blkio under /sys/fs/cgroup). The VMs' cgroups sit under the node's own cgroup (v1) or
beside it (v2, where a cgroup with processes may not also delegate controllers to
children), in ``space/<node tag>/<vm>``: nodes sharing a host keep their own.

A VM's cgroup is made before its QEMU starts (the jail joins it first, so every thread
QEMU makes is inside) and removed once the QEMU has exited; ``sweep`` removes what a
node that stopped uncleanly left.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from space.node.api import Unavailable

__all__ = ["CgroupLimits", "VmCgroups"]

log = logging.getLogger(__name__)

_ROOT = Path("/sys/fs/cgroup")
_CPU_PERIOD_US = 100_000
_V1_CONTROLLERS = ("memory", "cpu", "pids", "blkio")
_V2_CONTROLLERS = ("memory", "cpu", "pids", "io")


@dataclass(frozen=True, slots=True)
class CgroupLimits:
    """What one VMM may use: bytes of memory, CPUs (its vCPUs), tasks, an I/O weight."""

    memory_bytes: int
    cpus: int
    pids: int
    io_weight: int = 100


class VmCgroups:
    """The cgroups of one node's VMs, under ``root`` (the host's cgroup mount)."""

    def __init__(self, node_tag: str, *, root: Path = _ROOT, own: Path = Path("/proc/self/cgroup")):
        self._root = root
        self.unified = (root / "cgroup.controllers").is_file()
        #: One directory per hierarchy (one on v2) holding this node's VM cgroups.
        self.bases = self._find_bases(own.read_text(), node_tag)

    def _find_bases(self, own_cgroups: str, node_tag: str) -> list[Path]:
        """One base directory per hierarchy (a single one on v2)."""
        paths: dict[str, str] = {}
        for line in own_cgroups.splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path.lstrip("/")
        if self.unified:
            parent = Path(paths.get("", "")).parent if paths.get("") else Path()
            return [self._root / parent / "space" / node_tag]
        return [self._root / c / paths.get(c, "") / "space" / node_tag for c in _V1_CONTROLLERS]

    def create(self, vm: str, limits: CgroupLimits) -> list[Path]:
        """Make ``vm``'s cgroups with ``limits``; returns their ``cgroup.procs`` files
        (what the jail joins). Idempotent. Raises Unavailable if the host refuses."""
        try:
            return [self._create_one(base, vm, limits) for base in self.bases]
        except OSError as exc:
            self.remove(vm)
            raise Unavailable(f"cannot make the VM's cgroup: {exc}") from exc

    def _create_one(self, base: Path, vm: str, limits: CgroupLimits) -> Path:
        if self.unified:
            self._delegate(base)
        group = base / vm
        group.mkdir(mode=0o755, parents=True, exist_ok=True)
        for name, value in self._settings(base, limits):
            path = group / name
            if path.exists():  # blkio's weight exists only under a scheduler that has one
                path.write_text(value)
        return group / "cgroup.procs"

    def _settings(self, base: Path, limits: CgroupLimits) -> list[tuple[str, str]]:
        quota = limits.cpus * _CPU_PERIOD_US
        if self.unified:
            return [
                ("memory.max", str(limits.memory_bytes)),
                ("memory.swap.max", "0"),
                ("cpu.max", f"{quota} {_CPU_PERIOD_US}"),
                ("pids.max", str(limits.pids)),
                ("io.weight", f"default {limits.io_weight}"),
            ]
        controller = base.relative_to(self._root).parts[0]
        return {
            "memory": [("memory.limit_in_bytes", str(limits.memory_bytes))],
            "cpu": [("cpu.cfs_period_us", str(_CPU_PERIOD_US)), ("cpu.cfs_quota_us", str(quota))],
            "pids": [("pids.max", str(limits.pids))],
            "blkio": [
                ("blkio.weight", str(limits.io_weight)),
                ("blkio.bfq.weight", str(limits.io_weight)),
            ],
        }[controller]

    def _delegate(self, base: Path) -> None:
        """cgroup v2: enable the controllers from the root down to ``base`` itself."""
        path = self._root
        for part in (*base.relative_to(self._root).parts, None):
            available = (path / "cgroup.controllers").read_text().split()
            wanted = " ".join(f"+{c}" for c in _V2_CONTROLLERS if c in available)
            with contextlib.suppress(OSError):  # already on, or the root's own choice
                (path / "cgroup.subtree_control").write_text(wanted)
            if part is not None:
                path = path / part
                path.mkdir(mode=0o755, exist_ok=True)

    def remove(self, vm: str) -> None:
        """Remove ``vm``'s cgroups (their processes must have exited); logs, never raises."""
        for base in self.bases:
            try:
                (base / vm).rmdir()
            except FileNotFoundError:
                pass  # gone already, or never made
            except OSError as exc:
                log.warning("cannot remove cgroup %s: %s", base / vm, exc)

    def sweep(self) -> None:
        """Remove the node's VM cgroups that hold no process (their VMMs exited while no
        node watched; a launch in flight is not swept: call before any)."""
        for base in self.bases:
            with contextlib.suppress(FileNotFoundError):
                for group in base.iterdir():
                    if group.is_dir():
                        with contextlib.suppress(OSError):
                            if not (group / "cgroup.procs").read_text().strip():
                                group.rmdir()

    def remove_bases(self) -> None:
        """Remove the node's directories (and ``space`` above them) once they are empty."""
        for base in self.bases:
            for directory in (base, base.parent):
                with contextlib.suppress(OSError):
                    directory.rmdir()
