"""A jail per VMM: its own uid, no capabilities, its own namespaces, cgroup and seccomp.

Assume a guest escapes into its QEMU. What that QEMU can then reach is set here, the
way Firecracker's jailer confines each VMM:

- a uid of its own from ``JAIL_UIDS`` (never one another live VMM has), gid alike, no
  supplementary groups, an empty capability bounding set, ``no_new_privs``;
- a mount namespace whose root is a read-only tmpfs holding only ``/usr`` (read-only:
  QEMU, its libraries and firmware), four character devices (null, zero, random,
  urandom; and kvm when used), and this VM's own files bound at their host paths: kernel
  and initrd read-only, disk and console log read-write, its RAM file (read-only when
  mapped private: QEMU >= 8.2 maps it copy-on-write from a read-only descriptor), and
  its run directory (its QMP and channel sockets); and its secrets (the disk's
  passphrase) in files only it can read, under ``JAIL_SECRETS``. Nothing of another
  sandbox, the data dir's keys and database, or the host's /etc, /proc, /sys and /dev;
- its own PID, IPC and UTS namespaces, and a network namespace of its own that is
  empty: the guest's NIC is a descriptor on the sandbox's tap, opened in the sandbox's
  namespace before, so QEMU can open no socket anywhere useful;
- a cgroup with a memory limit (guest RAM plus the VMM's overhead), a CPU quota (its
  vCPUs), a pids limit and an I/O weight (``cgroups``);
- a seccomp filter denying what a VMM never needs (``_jail_exec.DENIED_SYSCALLS``),
  under QEMU's own ``-sandbox`` filter.

The jail is built by ``_jail_exec.py`` in a fresh interpreter (as root); the files the
VM needs are handed over to its uid here first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import select
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from space.node.api import Unavailable
from space.node.core.capacity import VM_OVERHEAD_MIB
from space.node.core.environment import child_environment
from space.node.vmm.cgroups import CgroupLimits, VmCgroups

__all__ = [
    "JAIL_SECRETS",
    "JAIL_UIDS",
    "TAP_FD",
    "Bind",
    "Jail",
    "jail_for",
    "jailed_uid_in_use",
    "release_uid",
    "take_uid",
]

#: The uids (and gids) jailed VMMs run as: far above any a distribution hands out, and
#: apart from the 100000-165535 range user namespaces are usually given.
JAIL_UIDS = range(1_500_000_000, 1_500_000_000 + 1_000_000)
#: The descriptor number the guest's tap has in QEMU.
TAP_FD = 3
#: Where a jailed program finds the secrets of its spawn (a file each, its uid's alone,
#: mode 0400): a directory of the jail's own root, which exists in the jail's mount
#: namespace only, so the key is on no host path, in no argv and no environment.
JAIL_SECRETS = Path("/secrets")
#: Threads a QEMU may have: its main loop, RCU and vCPU threads, and a block I/O pool
#: of up to 64 workers. A fork bomb in the jail stops here.
_PIDS_MAX = 128
#: Beyond VM_OVERHEAD_MIB (what admission charges a VM besides guest RAM), room for
#: TCG's 64 MiB translation cache and page cache of its own disk the kernel reclaims
#: first: the limit is a wall against runaway growth, not a tight fit.
_MEMORY_SLACK_MIB = 256

_EXEC = Path(__file__).with_name("_jail_exec.py")
_JAIL_ROOT = Path("/run/space-jail")
#: A launch is a fork, namespaces and mounts: milliseconds; past this the launcher hangs.
_LAUNCH_TIMEOUT_S = 30.0
_HOST_FILES = ("/usr", "/etc/ld.so.cache")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
_PR_SET_CHILD_SUBREAPER = 36
_JAILS: dict[Path, Jail] = {}
_launching: set[int] = set()


@dataclass(frozen=True, slots=True)
class Bind:
    """A host path the jail sees at the same path: ``ro``, ``rw`` or ``dev``."""

    path: Path
    mode: Literal["ro", "rw", "dev"]


class Jail:
    """The jails of one node's VMMs (one per run root, so per node)."""

    def __init__(self, run_root: Path) -> None:
        self.run_root = run_root
        self.cgroups = VmCgroups(run_root.name)
        self._broker = _Broker()

    async def spawn(
        self,
        name: str,
        argv: list[str],
        *,
        binds: Iterable[Bind],
        owned: Iterable[Path],
        netns: Path | None,
        tap: str,
        memory_mib: int,
        cpus: int,
        stderr_log: Path,
        pid_file: Path,
        secrets: dict[str, bytes] | None = None,
    ) -> int:
        """Start ``argv`` jailed as VM ``name``; returns its host pid once it runs.

        ``owned`` are handed to the jail's uid first (its disk, sockets' directory,
        console log...). Each of ``secrets`` (ASCII text) is the file
        ``JAIL_SECRETS/<name>`` in the jail, reaching the launcher through its pipe.
        Raises Unavailable if any step fails (the jail's own message is in
        ``stderr_log``); nothing is left running or in a cgroup then.
        """
        binary = shutil.which(argv[0])
        if binary is None:
            raise Unavailable(f"cannot find {argv[0]}")
        uid = take_uid()
        try:
            limits = CgroupLimits(
                memory_bytes=(memory_mib + VM_OVERHEAD_MIB + _MEMORY_SLACK_MIB) << 20,
                cpus=cpus,
                pids=_PIDS_MAX,
            )
            procs = await asyncio.to_thread(self.cgroups.create, name, limits)
            all_binds = [*_host_binds(binary), *binds]
            await asyncio.to_thread(_hand_over, owned, uid)
            spec = {
                "argv": [binary, *argv[1:]],
                "env": child_environment(),
                "uid": uid,
                "gid": uid,
                "root": str(self.jail_root()),
                "binds": [(str(b.path), b.mode) for b in all_binds],
                "cgroups": [str(p) for p in procs],
                "netns": str(netns) if netns is not None else None,
                "tap": tap,
                "tap_fd": TAP_FD,
                "pid_file": str(pid_file),
                "log": str(stderr_log),
                "sched_batch": True,
                "secrets": {k: v.decode("ascii") for k, v in (secrets or {}).items()},
                "secrets_dir": str(JAIL_SECRETS),
            }
            await asyncio.to_thread(self._broker.launch, spec, pid_file)
            return _read_pid(pid_file)
        except (OSError, ValueError) as exc:
            self.cgroups.remove(name)
            raise Unavailable(f"cannot start the jailed VMM: {exc}") from exc
        except BaseException:
            self.cgroups.remove(name)
            raise
        finally:
            release_uid(uid)

    def jail_root(self) -> Path:
        """An empty directory each jail's root is mounted on, in the jail's own mount
        namespace only: one for every node, never removed (a VMM may outlive a node)."""
        _JAIL_ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)
        return _JAIL_ROOT

    def release(self, name: str) -> None:
        """The VMM ``name`` has exited: remove its cgroup."""
        self.cgroups.remove(name)

    def sweep(self) -> None:
        """Remove what VMMs that exited while no node watched left (their cgroups)."""
        self.cgroups.sweep()

    def close(self) -> None:
        """The node stops: end the launcher, and remove the cgroups' parents if no VMM
        is left in them. Running VMMs are not touched."""
        self._broker.stop()
        self.cgroups.remove_bases()
        _JAILS.pop(self.run_root, None)


def jail_for(run_root: Path) -> Jail:
    """The jail of the node whose run directories are under ``run_root``."""
    jail = _JAILS.get(run_root)
    if jail is None:
        _become_subreaper()
        jail = _JAILS[run_root] = Jail(run_root)
    return jail


def take_uid() -> int:
    """A jail uid no live process has and no launch in flight is taking."""
    in_use = jailed_uid_in_use() | _launching
    for uid in JAIL_UIDS:
        if uid not in in_use:
            _launching.add(uid)
            return uid
    raise Unavailable(f"all {len(JAIL_UIDS)} jail uids are in use")


def release_uid(uid: int) -> None:
    """End the reservation ``take_uid`` made, once a process runs as ``uid`` (or its
    launch failed); idempotent."""
    _launching.discard(uid)


def jailed_uid_in_use() -> set[int]:
    """The jail uids of live processes (a /proc directory belongs to its process's uid)."""
    found = set()
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                try:
                    uid = entry.stat().st_uid
                except OSError:
                    continue
                if uid in JAIL_UIDS:
                    found.add(uid)
    return found


def _host_binds(binary: str) -> list[Bind]:
    binds = [Bind(Path(p), "ro") for p in _HOST_FILES if os.path.exists(p)]
    if not binary.startswith("/usr/"):
        binds.append(Bind(Path(binary), "ro"))
    return binds + [Bind(Path(d), "dev") for d in _DEVICES]


def _hand_over(paths: Iterable[Path], uid: int) -> None:
    for path in paths:
        os.chown(path, uid, uid)


class _Broker:
    """The jail's launcher (``_jail_exec.py``), kept running as root: each launch forks
    from it, which saves the ~50 ms a fresh interpreter and its imports take. Started
    on first use and again if it died; blocking calls, so run them in a thread."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def launch(self, spec: dict[str, object], pid_file: Path) -> None:
        """One launch; Unavailable if it failed (the jail's message is in the spec's log)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pid_file)
        request = json.dumps(spec).encode() + b"\n"
        with self._lock:
            answer = self._ask(request)  # a launcher that had died is started anew first
        if answer is None:
            self.stop()
            raise Unavailable("the VMM's jail launcher did not answer")
        if answer.get("status") != 0:
            raise Unavailable("the VMM's jail failed")

    def _ask(self, request: bytes) -> dict[str, object] | None:
        proc = self._running()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(request)
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], _LAUNCH_TIMEOUT_S)
            line = proc.stdout.readline() if ready else b""
            return dict(json.loads(line)) if line else None
        except (OSError, ValueError):
            return None

    def _running(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_EXEC)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                start_new_session=True, env={},
            )  # fmt: skip
        return self._proc

    def stop(self) -> None:
        """End the launcher (it exits when its stdin closes); what it started runs on."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _read_pid(pid_file: Path) -> int:
    with open(pid_file) as f:
        return int(f.read())


def _become_subreaper() -> None:
    """Jailed VMMs are orphaned by their launcher: make them this process's children,
    so they are reaped here (and watched with pidfds as before)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
