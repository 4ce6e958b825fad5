"""The jails of one node's VMMs, built as root: uids, cgroups, hand-over, launches.

``space.node.vmm.jail`` says what a jail holds; this is the part that needs root. A
launch takes a uid no live process has (``take_uid``; the egress gateway's comes from
here too), makes the VM's cgroups, hands its files to that uid and asks the launcher
(``_jail_exec.py``, kept running: each launch forks from it, which saves the ~50 ms a
fresh interpreter and its imports take) to build the jail and exec.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

from space.node.api import InvalidArgument, Unavailable
from space.node.core.capacity import VM_OVERHEAD_MIB
from space.node.core.environment import child_environment
from space.node.network.netns import netns_path
from space.node.privileged.cgroups import CgroupLimits, VmCgroups
from space.node.privileged.pinned import Pinned
from space.node.vmm.jail import JAIL_SECRETS, JAIL_UIDS, TAP_FD

__all__ = ["Jails", "jailed_uid_in_use", "release_uid", "share", "share_held", "take_uid"]

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
_launching: set[int] = set()


class Jails:
    """The jails of the node whose VMs' run directories are under ``run_root``."""

    def __init__(self, run_root: Path, owner: tuple[int, int]) -> None:
        self.cgroups = VmCgroups(run_root.name)
        self._owner = owner
        self._launcher = _Launcher()

    async def launch(
        self,
        name: str,
        argv: list[str],
        *,
        binds: list[tuple[Pinned, str]],
        devices: list[str],
        owned: list[Pinned],
        netns: str | None,
        tap: str,
        memory_mib: int,
        cpus: int,
        stderr_log: Pinned,
        pid_file: Pinned,
        secrets: dict[str, str],
    ) -> int:
        """Start ``argv`` jailed as VM ``name``; returns its host pid once it runs.
        ``binds`` are (file, ro|rw) and ``devices`` host devices, each at its own path
        in the jail; ``stderr_log`` and ``pid_file`` are names in held directories.

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
            await asyncio.to_thread(_hand_over, owned, uid, self._owner[1])
            owned_texts = {p.text for p in owned}
            for pinned, mode in binds:
                if mode == "ro" and pinned.text not in owned_texts:
                    await asyncio.to_thread(_readable, pinned.fd)
            spec = {
                "argv": [binary, *argv[1:]],
                "env": child_environment(),
                "uid": uid,
                "gid": uid,
                "root": str(_jail_root()),
                "binds": [
                    *_host_binds(binary),
                    *((str(p.path), p.text, mode) for p, mode in binds),
                    *((d, d, "dev") for d in devices),
                ],
                "cgroups": [str(p) for p in procs],
                "netns": str(netns_path(netns)) if netns is not None else None,
                "tap": tap,
                "tap_fd": TAP_FD,
                "pid_file": str(pid_file.path),
                "log": str(stderr_log.path),
                "sched_batch": True,
                "secrets": secrets,
                "secrets_dir": str(JAIL_SECRETS),
            }
            try:
                await asyncio.to_thread(self._launcher.launch, spec, pid_file.path)
            finally:  # the jail's own message is for the node agent to read
                with contextlib.suppress(FileNotFoundError):
                    os.chown(stderr_log.path, *self._owner, follow_symlinks=False)
            os.chown(pid_file.path, *self._owner, follow_symlinks=False)
            return _read_pid(pid_file.path)
        except (OSError, ValueError) as exc:
            self.cgroups.remove(name)
            raise Unavailable(f"cannot start the jailed VMM: {exc}") from exc
        except BaseException:
            self.cgroups.remove(name)
            raise
        finally:
            release_uid(uid)

    def close(self) -> None:
        """End the launcher, and remove the cgroups' parents if no VMM is left in
        them. Running VMMs are not touched."""
        self._launcher.stop()
        self.cgroups.remove_bases()


def signal_vm(pidfd: int, run_dir: Path, signum: int) -> None:
    """Send ``signum`` to the process of ``pidfd`` if it is a jailed VMM serving
    ``run_dir`` (a pidfd: no recycled pid can be hit). Raises InvalidArgument if not."""
    pid = _pid_of(pidfd)
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return  # it has exited already
    if uid not in JAIL_UIDS or f"{run_dir}/".encode() not in argv:
        raise InvalidArgument(f"pid {pid} is not the jailed VMM of {run_dir}")
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signum)


def _pid_of(pidfd: int) -> int:
    with open(f"/proc/self/fdinfo/{pidfd}") as info:
        for line in info:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise InvalidArgument("not a pidfd")


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


def _hand_over(files: Iterable[Pinned], uid: int, group: int) -> None:
    for pinned in files:
        share_held(pinned.fd, uid, group)


def _readable(fd: int) -> None:
    """Let every jail read the regular file held by ``fd`` that it is bound read-only
    and does not own (a ready state's RAM image, mapped by every sandbox of its
    template): the data dir's modes keep it from anyone else on the host."""
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and info.st_mode & 0o044 != 0o044:
        os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(info.st_mode) | 0o044)


def share(path: Path | str, uid: int, group: int, *, dir_fd: int | None = None) -> None:
    """``share_held`` of ``path`` (in ``dir_fd``), opened without following a link: a
    link put in its place after the broker checked it gives nothing of what it
    points to. Raises OSError for a link or anything but a file or directory."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        share_held(fd, uid, group)
    finally:
        os.close(fd)


def share_held(fd: int, uid: int, group: int) -> None:
    """Give the file or directory ``fd`` holds to ``uid``, its group the node agent's
    (``group``), which may read and write it too (a directory also set-group-id: what
    is made in it stays in the group): the agent reads a VM's console log and disk
    header and connects to its sockets, nobody else can. A jailed uid has no
    supplementary group. Raises OSError for anything but a file or directory."""
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise OSError(f"{os.readlink(f'/proc/self/fd/{fd}')} is neither a file nor a directory")
    held = f"/proc/self/fd/{fd}"  # leads to exactly the file held, even an O_PATH one
    os.chown(held, uid, group)
    extra = 0o070 | stat.S_ISGID if stat.S_ISDIR(mode) else 0o060
    os.chmod(held, stat.S_IMODE(mode) | extra)


def _jail_root() -> Path:
    """An empty directory each jail's root is mounted on, in the jail's own mount
    namespace only: one for every node, never removed (a VMM may outlive a node)."""
    _JAIL_ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)
    return _JAIL_ROOT


def _host_binds(binary: str) -> list[tuple[str, str, str]]:
    """(source, path in the jail, mode) of what every jail has of the host's."""
    binds = [(p, p, "ro") for p in _HOST_FILES if os.path.exists(p)]
    if not binary.startswith("/usr/"):
        binds.append((binary, binary, "ro"))
    return binds + [(d, d, "dev") for d in _DEVICES]


class _Launcher:
    """``_jail_exec.py``, kept running: started on first use and again if it died;
    blocking calls, so run them in a thread."""

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
    fd = os.open(pid_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd) as f:
        return int(f.read(32))
