"""gVisor sandboxes as root: each sandbox's copy-on-write clone of its template's
directory tree (made by space.node.privileged._gvisor_tree), and ``runsc`` starting
and removing its sandbox (issue 21).

The node agent names what; everything a container gets is decided here, from bounded
fields only: the root filesystem (a subvolume of the pool), the process (spaced on
the stdio the agent handed over), the network namespace (one of the node's), the
resources. A compromised agent can thus start nothing but a sandbox of this shape.

What was measured on these hosts, and why each runsc flag:

- ``--platform=ptrace``: the KVM platform spins under this host's PVM; systrap (newer
  builds only) spawns a process in 17.6 ms against ptrace's 7.7 ms here.
- ``--network=sandbox``: gVisor's own network stack on the guest's link, alone in
  the second namespace of the sandbox's (space.node.network.netns), whose other end
  meets the namespace's nftables ruleset as a VM's tap does; its sockets are gVisor's,
  never the host kernel's, and runsc can checkpoint it (it cannot checkpoint the
  host's stack, ``--network=host``: "checkpoint not supported when using hostinet").
  ``--net-disconnect-ok``: a checkpoint resets the guest's open TCP connections, as
  a VM's are lost when it wakes in another namespace; without it runsc refuses to
  save while any is open, even one closing ("endpoint cannot be saved in connected
  state").
  This runsc refuses its own stack in any namespace where
  ``/proc/sys/net/core/rmem_default`` exists, its test for the host's root namespace,
  which every namespace has on this kernel; so runsc run and restore go through a
  mount namespace of their own where ``/proc/sys`` holds only ``kernel`` and ``vm``,
  the two runsc reads (``_HIDE_NET_SYSCTLS``). A sandbox whose volume has no NIC
  marker (made before gVisor sandboxes had a link) runs ``--network=none``, loopback
  only, in its one namespace.
- A network namespace's guest gets ``/etc/resolv.conf`` naming the gateway (the
  text a VM's init writes from ``space.net=``), a read-only bind mount of a file in
  its root-only bundle: nothing in its volume is written by root, and the gateway
  answers DNS sent to any address anyway. Raw sockets stay refused (runsc's default
  without ``--net-raw``).
- ``--overlay2=none``: the guest writes into its volume (copy-on-write on btrfs,
  limited by its quota group), not into an overlay in memory or a hidden filestore.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from ipaddress import IPv4Address
from pathlib import Path

from space.node.api import InvalidArgument, Unavailable
from space.node.core.run import run
from space.node.network.netns import GATEWAY_ADDRESS, netns_path
from space.node.privileged._gvisor_state import release_images
from space.node.privileged.pinned import Pinned
from space.protocol import resolv_conf_text

__all__ = [
    "GUEST_PROCESS",
    "OVERHEAD_MIB",
    "RESOLV_CONF",
    "ROOTFS",
    "TREE_ROOT",
    "clone_tree",
    "launch",
    "oci_config",
    "pause",
    "release_home",
    "remove",
    "runsc_argv",
]

#: The runsc every node uses: the Debian package's, on root's PATH.
RUNSC = "runsc"
#: The guest's init: the same spaced as in a VM, speaking on stdin/stdout (the socket
#: the agent handed over), from the package the image build installed; ``--gvisor``:
#: a fresh identity after a restore renames the sandbox (space.guest._identity).
GUEST_PROCESS = ["/usr/bin/python3", "-B", "-m", "space.guest", "--stdio", "--gvisor"]
_GUEST_ENV = [
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG=C.UTF-8",
    "PYTHONPATH=/usr/lib/space/python",
    "HOME=/root",
]
#: Memory the sandbox's cgroup holds beyond the guest's own: gVisor's kernel (the
#: sentry, about 30 MiB resident measured) and its file server (the gofer).
OVERHEAD_MIB = 64
_PIDS_LIMIT = 4096
#: Root in a gVisor sandbox is root of gVisor's kernel: it may have every capability
#: spaced needs (switching to the sandbox's user, owning its files) at no cost to the host.
_CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
    "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_NET_RAW", "CAP_SYS_CHROOT", "CAP_MKNOD", "CAP_AUDIT_WRITE", "CAP_SETFCAP",
    "CAP_SYS_PTRACE", "CAP_SYS_RESOURCE", "CAP_SYS_NICE", "CAP_SYS_ADMIN",
]  # fmt: skip
#: The kernel file systems a VM's init mounts, mounted for the guest here instead.
_MOUNTS = [
    {"destination": "/proc", "type": "proc", "source": "proc"},
    {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["ro"]},
    {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["mode=755"]},
    {"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
    {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["mode=1777"]},
    {"destination": "/run", "type": "tmpfs", "source": "tmpfs", "options": ["mode=755"]},
    {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["mode=1777"]},
]
_RUN_TIMEOUT_S = 60.0
#: A networked runsc run or restore's prelude (see the module docstring): /proc/sys,
#: in a mount namespace of its own, with only ``kernel`` and ``vm`` bound back (by
#: descriptor: their names are covered by then).
_HIDE_NET_SYSCTLS = (
    "set -e; exec 3</proc/sys/kernel 4</proc/sys/vm;"
    " mount -t tmpfs -o mode=555,size=4k none /proc/sys;"
    " mkdir /proc/sys/kernel /proc/sys/vm;"
    " mount --no-canonicalize --bind /proc/self/fd/3 /proc/sys/kernel;"
    " mount --no-canonicalize --bind /proc/self/fd/4 /proc/sys/vm;"
    ' exec 3<&- 4<&-; exec "$@"'
)
#: The sandbox's root in its bundle: the volume bind-mounted there (``launch``).
ROOTFS = "rootfs"
#: The guest's root directory in a tree and in each sandbox volume cloned from it.
TREE_ROOT = "rootfs"
#: The guest's resolver file in its bundle (see the module docstring).
RESOLV_CONF = "resolv.conf"
_CGROUP_ROOT = Path("/sys/fs/cgroup")


async def clone_tree(tree: Pinned, volume: Pinned) -> None:
    """Make ``volume`` (absent) a writable snapshot of the subvolume ``tree``."""
    await run("btrfs", "subvolume", "snapshot", str(tree.path), str(volume.path))


def oci_config(
    *,
    rootfs: str,
    hostname: str,
    netns: str | None,
    cpus: int,
    memory_mib: int,
    cgroup: str,
) -> dict[str, object]:
    """The OCI runtime spec of one sandbox (see the module docstring), in the network
    namespace ``netns`` (a name: the guest link's one, or a sandbox's without one)."""
    namespaces: list[dict[str, str]] = [
        {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
    ]  # fmt: skip
    mounts = list(_MOUNTS)
    if netns is not None:
        namespaces.append({"type": "network", "path": str(netns_path(netns))})
        mounts.append(
            {
                "destination": "/etc/resolv.conf",
                "type": "bind",
                "source": RESOLV_CONF,
                "options": ["bind", "ro"],
            }
        )
    caps = list(_CAPABILITIES)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": GUEST_PROCESS,
            "env": _GUEST_ENV,
            "cwd": "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
        },
        "root": {"path": rootfs, "readonly": False},
        "hostname": hostname,
        "mounts": mounts,
        "linux": {
            "namespaces": namespaces,
            "cgroupsPath": cgroup,
            "resources": {
                "memory": {"limit": (memory_mib + OVERHEAD_MIB) << 20},
                "cpu": {"quota": cpus * 100_000, "period": 100_000},
                "pids": {"limit": _PIDS_LIMIT},
            },
        },
    }


def runsc_argv(state: Path) -> list[str]:
    """runsc and its global flags (see the module docstring); a run or restore adds
    its network's (``launch``)."""
    return [RUNSC, f"--root={state}", "--platform=ptrace", "--overlay2=none"]


async def launch(
    name: str,
    *,
    home: Path,
    config: dict[str, object],
    rootfs: Pinned,
    channel_fd: int,
    log: Pinned,
    owner: tuple[int, int],
    image: Path | None = None,
    networked: bool = False,
) -> int:
    """Start the sandbox ``name`` (``config``: ``oci_config``'s, its root ``ROOTFS``)
    on the held volume ``rootfs`` with ``channel_fd`` as its init's stdin and stdout;
    returns the pid of its runsc sandbox process, which lives as long as the sandbox.
    ``home`` holds runsc's state and bundles. With ``image`` (a directory holding a
    checkpoint, space.node.privileged._gvisor_state) the sandbox is restored from it
    instead of booted: runsc hands the restored init the stdio it is given now, so
    ``channel_fd`` is a new channel to the same spaced. ``networked``: gVisor's
    stack on the guest's link in the config's namespace, addressed already
    (space.node.privileged._network.address_guest; see the module docstring).

    runsc's processes look the root up by name in mount namespaces of their own, where
    the broker's descriptors are not, and the volume is in the agent's pool: a name
    there could be swapped for a link to ``/`` after the check. So the held volume is
    bind-mounted into the bundle, root's alone, and runsc is given that.
    ``log`` must be a file of the agent's (``owner``): runsc's output goes to a file
    the agent reads, never to one root opened for it elsewhere.
    Raises Unavailable (runsc's own words); nothing is left running then.
    """
    log_fd = await asyncio.to_thread(_open_log, log, owner)
    cgroup = str(config["linux"]["cgroupsPath"])  # type: ignore[index]
    try:
        bundle = home / "bundles" / name
        await asyncio.to_thread(_write_bundle, bundle, config)
        await run("mount", "--no-canonicalize", "--bind", str(rootfs.path), str(bundle / ROOTFS))
        start = ["run"] if image is None else ["restore", f"--image-path={image}"]
        argv = [
            *runsc_argv(home / "state"),
            *(["--network=sandbox", "--net-disconnect-ok"] if networked else ["--network=none"]),
            *start, "--detach", "--pid-file", str(bundle / "pid"), "--bundle", str(bundle), name,
        ]  # fmt: skip
        if networked:
            argv = [
                "unshare", "--mount", "--propagation", "private", "--",
                "sh", "-c", _HIDE_NET_SYSCTLS, "runsc", *argv,
            ]  # fmt: skip
        proc = None
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=channel_fd, stdout=channel_fd, stderr=log_fd, start_new_session=True
            )
            async with asyncio.timeout(_RUN_TIMEOUT_S):
                code = await proc.wait()
            if code != 0:
                raise Unavailable(f"runsc {start[0]} exited with {code}: {_tail(log.path)}")
            return int(await asyncio.to_thread((bundle / "pid").read_text))
        except BaseException:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            await remove(name, home=home, cgroup=cgroup)
            raise
    finally:
        os.close(log_fd)


def _open_log(log: Pinned, owner: tuple[int, int]) -> int:
    fd = os.open(log.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    if os.fstat(fd).st_uid != owner[0]:
        os.close(fd)
        raise InvalidArgument(f"{log.text} is not the node agent's file")
    return fd


def _write_bundle(bundle: Path, config: dict[str, object]) -> None:
    bundle.mkdir(mode=0o700, parents=True, exist_ok=True)
    (bundle / ROOTFS).mkdir(mode=0o700, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(config))
    (bundle / "pid").unlink(missing_ok=True)
    linux = config["linux"]
    assert isinstance(linux, dict)
    if any(ns.get("type") == "network" for ns in linux["namespaces"]):
        resolver = resolv_conf_text(IPv4Address(GATEWAY_ADDRESS))
        (bundle / RESOLV_CONF).write_text(resolver)
        (bundle / RESOLV_CONF).chmod(0o644)


async def remove(name: str, *, home: Path, cgroup: str) -> None:
    """Kill the sandbox ``name`` and delete its runsc state, cgroup and bundle;
    idempotent (a sandbox runsc does not know is gone)."""
    state = home / "state"
    if await asyncio.to_thread(state.is_dir):
        await run(*runsc_argv(state), "delete", "--force", name, check=False)
    bundle = home / "bundles" / name
    if await asyncio.to_thread(os.path.ismount, bundle / ROOTFS):
        await run("umount", "--no-canonicalize", "--lazy", str(bundle / ROOTFS))
    await asyncio.to_thread(_remove_rest, bundle, cgroup)


def _remove_rest(bundle: Path, cgroup: str) -> None:
    """The bundle, and the cgroup a runsc that failed half-way left (runsc's delete
    removes it only for a container it made): empty once its processes are gone.

    The bundle's files one by one, never a tree: its root is the sandbox's volume
    while mounted there (an unmount that failed leaves the bundle, not a lost volume).
    """
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(bundle):
            if entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
    for directory in (bundle / ROOTFS, bundle):
        with contextlib.suppress(OSError):
            directory.rmdir()
    relative = cgroup.strip("/")
    for group in (_CGROUP_ROOT / relative, *_CGROUP_ROOT.glob(f"*/{relative}")):
        with contextlib.suppress(OSError):
            group.rmdir()


async def pause(name: str, *, home: Path, paused: bool) -> None:
    """``runsc pause`` (``paused``) or ``runsc resume`` the sandbox ``name``: its
    tasks stop or go on, its memory and its channel stay; idempotent."""
    runsc = runsc_argv(home / "state")
    try:
        await run(*runsc, "pause" if paused else "resume", name)
    except Unavailable:
        # runsc refuses to pause a paused sandbox (or resume a running one): idempotent.
        state = json.loads(await run(*runsc, "state", name)).get("status")
        if state != ("paused" if paused else "running"):
            raise


def release_home(home: Path) -> None:
    """Remove runsc's directories once no sandbox uses them (the node stops)."""
    release_images(home)
    for directory in (home / "bundles", home / "state", home):
        with contextlib.suppress(OSError):
            directory.rmdir()


def _tail(path: Path, max_bytes: int = 2048) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
