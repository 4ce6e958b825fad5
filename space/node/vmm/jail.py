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

The jail is built by the root broker (space.node.privileged: ``_jails`` and its
launcher ``_jail_exec.py``), which also hands the VM's files to its uid first; this
module says what a jail holds and asks for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from space.node.api import NodeError
from space.node.privileged import broker_for
from space.node.privileged.requests import LaunchVm, ReleaseVm, SignalVm, SweepVms

__all__ = [
    "JAIL_SECRETS",
    "JAIL_UIDS",
    "TAP_FD",
    "Bind",
    "Jail",
    "jail_for",
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
_PR_SET_CHILD_SUBREAPER = 36
_JAILS: dict[Path, Jail] = {}
#: Releases in flight (a VMM's exit is seen in a reader callback, not a coroutine).
_RELEASES: set[asyncio.Task[None]] = set()


@dataclass(frozen=True, slots=True)
class Bind:
    """A host path the jail sees at the same path: ``ro``, ``rw`` or ``dev`` (a
    device: the jail gets a node of its own, /dev/kvm only)."""

    path: Path
    mode: Literal["ro", "rw", "dev"]


class Jail:
    """The jails of one node's VMMs (one per run root, so per node)."""

    def __init__(self, run_root: Path) -> None:
        self.run_root = run_root
        #: Each VM's release still in flight, by name: a VM of the same name (a sandbox
        #: resumed after its hibernation) waits for it, or the late release would
        #: remove the new VM's cgroup before its VMM joins it.
        self._releasing: dict[str, asyncio.Task[None]] = {}

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
        ``JAIL_SECRETS/<name>`` in the jail, reaching the launcher through the broker's
        socket and its pipe. Raises Unavailable if any step fails (the jail's own
        message is in ``stderr_log``); nothing is left running or in a cgroup then.
        """
        request = LaunchVm(
            name=name,
            argv=argv,
            binds=[(str(b.path), b.mode) for b in binds],
            owned=[str(p) for p in owned],
            netns=netns.name if netns is not None else None,
            tap=tap,
            memory_mib=memory_mib,
            cpus=cpus,
            stderr_log=str(stderr_log),
            pid_file=str(pid_file),
            secrets={k: v.decode("ascii") for k, v in (secrets or {}).items()},
        )
        releasing = self._releasing.get(name)
        if releasing is not None:
            await asyncio.wait({releasing})  # a release never raises
        pid = await broker_for(self.run_root).call(request)
        assert isinstance(pid, int)
        return pid

    async def signal(self, pidfd: int, run_dir: Path, signum: signal.Signals) -> None:
        """Send ``signum`` to the VMM of ``pidfd`` (its uid is not the node's)."""
        await broker_for(self.run_root).call(
            SignalVm(run_dir=str(run_dir), signal=int(signum)), fds=(pidfd,)
        )

    def release(self, name: str) -> None:
        """The VMM ``name`` has exited: remove its cgroup (in the background; what a
        node that closed meanwhile leaves, its next start sweeps). Never raises."""
        task = asyncio.get_running_loop().create_task(self._release(name))
        _RELEASES.add(task)
        self._releasing[name] = task

        def done(finished: asyncio.Task[None]) -> None:
            _RELEASES.discard(finished)
            if self._releasing.get(name) is finished:
                del self._releasing[name]

        task.add_done_callback(done)

    async def _release(self, name: str) -> None:
        with contextlib.suppress(NodeError):
            await broker_for(self.run_root).call(ReleaseVm(name=name))

    async def sweep(self) -> None:
        """Remove what VMMs that exited while no node watched left (their cgroups)."""
        await broker_for(self.run_root).call(SweepVms())

    def close(self) -> None:
        """The node stops (its broker ends the launcher and removes the cgroups'
        parents); running VMMs are not touched (they are this process's children
        already). With no node left in the process it is no subreaper any more: an
        orphan it took on later would be reaped by no one, and ``runsc delete`` waits
        for a gVisor sandbox's process to be reaped (seen in tests: a node run in the
        test process, then a `space serve` whose runsc processes it outlived)."""
        _JAILS.pop(self.run_root, None)
        if not _JAILS:
            _set_subreaper(False)


def jail_for(run_root: Path) -> Jail:
    """The jail of the node whose run directories are under ``run_root``."""
    jail = _JAILS.get(run_root)
    if jail is None:
        _set_subreaper(True)
        jail = _JAILS[run_root] = Jail(run_root)
    return jail


def _set_subreaper(on: bool) -> None:
    """Jailed VMMs are orphaned by their launcher: make them this process's children,
    so they are reaped here (and watched with pidfds as before)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)
