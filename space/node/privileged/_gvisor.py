"""gVisor sandboxes as root: a template's directory tree, each sandbox's copy-on-write
clone of it, and ``runsc`` starting and removing its sandbox (issue 21).

The node agent names what; everything a container gets is decided here, from bounded
fields only: the root filesystem (a subvolume of the pool), the process (spaced on
the stdio the agent handed over), the network namespace (one of the node's), the
resources. A compromised agent can thus start nothing but a sandbox of this shape.

What was measured on these hosts, and why each runsc flag:

- ``--platform=ptrace``: the KVM platform spins under this host's PVM; systrap (newer
  builds only) spawns a process in 17.6 ms against ptrace's 7.7 ms here.
- ``--network=host`` inside the sandbox's own namespace: ``--network=sandbox`` is
  refused by Debian's runsc on this kernel ("cannot run with network enabled in root
  network namespace": its root-namespace test looks for a sysctl every namespace has
  now). With ``host``, the guest's sockets are the host kernel's in that namespace,
  so the namespace's nftables ruleset (default deny: the output chain drops) governs
  them; its one route is the /30 to the gateway address.
- ``--overlay2=none``: the guest writes into its volume (copy-on-write on btrfs,
  limited by its quota group), not into an overlay in memory or a hidden filestore.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
from pathlib import Path

from space.node.api import InvalidArgument, Unavailable
from space.node.core.run import run
from space.node.network.netns import netns_path
from space.node.privileged.pinned import Pinned

__all__ = [
    "GUEST_PROCESS",
    "OVERHEAD_MIB",
    "ROOTFS",
    "clone_tree",
    "launch",
    "make_tree",
    "oci_config",
    "release_home",
    "remove",
    "runsc_argv",
]

#: The runsc every node uses: the Debian package's, on root's PATH.
RUNSC = "runsc"
#: The guest's init: the same spaced as in a VM, speaking on stdin/stdout (the socket
#: the agent handed over), from the package the image build installed.
GUEST_PROCESS = ["/usr/bin/python3", "-B", "-m", "space.guest", "--stdio"]
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
#: The sandbox's root in its bundle: the volume bind-mounted there (``launch``).
ROOTFS = "rootfs"
_CGROUP_ROOT = Path("/sys/fs/cgroup")


async def make_tree(image_fd: int, parent: Pinned) -> None:
    """Unpack the ext4 image open as ``image_fd`` into the subvolume ``parent.name``
    of the directory ``parent`` holds; a no-op if it exists. What exists is complete:
    a tree is unpacked elsewhere and renamed into place once checked.

    ``debugfs rdump`` reads the image without mounting it and, run as root, keeps
    every file's owner and mode. It writes by path names, and the image is the agent's,
    so it unpacks inside a directory of root's alone (0700): the agent can put no link
    in the way of those writes, in a directory of its own or in a world-writable one
    of the image (its /tmp) alike.
    """
    assert parent.name is not None
    if await asyncio.to_thread(_exists, parent):
        return
    scratch, leftover = await asyncio.to_thread(_root_scratch, parent)
    staging = Path(f"/proc/{os.getpid()}/fd/{scratch}") / "tree"
    try:
        if leftover:  # an unpack cut short (the broker stopped): start again
            await run("btrfs", "subvolume", "delete", str(staging), check=False)
        await run("btrfs", "subvolume", "create", str(staging))
        try:
            out = await run(
                "debugfs", "-R", f"rdump / {staging}", f"/proc/{os.getpid()}/fd/{image_fd}",
                timeout_s=300.0,
            )  # fmt: skip
            await asyncio.to_thread(_publish, scratch, parent, out)
        except BaseException:
            await run("btrfs", "subvolume", "delete", str(staging), check=False)
            raise
    finally:
        await asyncio.to_thread(_drop_scratch, scratch, parent)


def _exists(parent: Pinned) -> bool:
    assert parent.name is not None
    try:
        os.stat(parent.name, dir_fd=parent.fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _scratch_name(parent: Pinned) -> str:
    return f".{parent.name}.unpacking"


def _root_scratch(parent: Pinned) -> tuple[int, bool]:
    """A directory of root's alone beside the tree to be, held open, and whether it
    was there already (only root makes one that is root's: a leftover of ours)."""
    name = _scratch_name(parent)
    leftover = False
    try:
        os.mkdir(name, 0o700, dir_fd=parent.fd)
    except FileExistsError:
        leftover = True
    try:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, dir_fd=parent.fd)
    except OSError as exc:  # a link or a file of the agent's in its place
        raise Unavailable(f"{name} in {parent.text} is not a directory of root's") from exc
    held = os.fstat(fd)
    if held.st_uid != 0 or stat.S_IMODE(held.st_mode) != 0o700:
        os.close(fd)
        raise Unavailable(f"{name} in {parent.text} is not a directory of root's alone")
    return fd, leftover


def _publish(scratch: int, parent: Pinned, debugfs_out: str) -> None:
    """Check an unpacked tree and move it to its final name."""
    assert parent.name is not None
    if "rdump:" in debugfs_out or not os.path.exists(
        f"/proc/self/fd/{scratch}/tree/usr/bin/python3"
    ):
        raise Unavailable(f"unpacking the guest image failed: {debugfs_out[-500:]}")
    os.chmod("tree", 0o755, dir_fd=scratch)
    os.rename("tree", parent.name, src_dir_fd=scratch, dst_dir_fd=parent.fd)


def _drop_scratch(scratch: int, parent: Pinned) -> None:
    """Remove the (then empty) scratch directory, if it is still the one made."""
    try:
        made = os.fstat(scratch)
        there = os.stat(_scratch_name(parent), dir_fd=parent.fd, follow_symlinks=False)
        if (made.st_dev, made.st_ino) == (there.st_dev, there.st_ino):
            os.rmdir(_scratch_name(parent), dir_fd=parent.fd)
    except OSError:
        pass  # gone, moved or not empty: the agent's doing, and nothing of root's is in it
    finally:
        os.close(scratch)


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
    """The OCI runtime spec of one sandbox (see the module docstring)."""
    namespaces: list[dict[str, str]] = [
        {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
    ]  # fmt: skip
    if netns is not None:
        namespaces.append({"type": "network", "path": str(netns_path(netns))})
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
        "mounts": _MOUNTS,
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


def runsc_argv(state: Path, *, networked: bool) -> list[str]:
    """runsc and its global flags (see the module docstring)."""
    return [
        RUNSC,
        f"--root={state}",
        "--platform=ptrace",
        f"--network={'host' if networked else 'none'}",
        "--overlay2=none",
    ]


async def launch(
    name: str,
    *,
    home: Path,
    config: dict[str, object],
    rootfs: Pinned,
    channel_fd: int,
    log: Pinned,
    owner: tuple[int, int],
) -> int:
    """Start the sandbox ``name`` (``config``: ``oci_config``'s, its root ``ROOTFS``)
    on the held volume ``rootfs`` with ``channel_fd`` as its init's stdin and stdout;
    returns the pid of its runsc sandbox process, which lives as long as the sandbox.
    ``home`` holds runsc's state and bundles.

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
        networked = await asyncio.to_thread(_write_bundle, bundle, config)
        await run("mount", "--no-canonicalize", "--bind", str(rootfs.path), str(bundle / ROOTFS))
        argv = [
            *runsc_argv(home / "state", networked=networked),
            "run", "--detach", "--pid-file", str(bundle / "pid"), "--bundle", str(bundle), name,
        ]  # fmt: skip
        proc = None
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=channel_fd, stdout=channel_fd, stderr=log_fd, start_new_session=True
            )
            async with asyncio.timeout(_RUN_TIMEOUT_S):
                code = await proc.wait()
            if code != 0:
                raise Unavailable(f"runsc run exited with {code}: {_tail(log.path)}")
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


def _write_bundle(bundle: Path, config: dict[str, object]) -> bool:
    """Write the bundle; whether the sandbox has a network namespace."""
    bundle.mkdir(mode=0o700, parents=True, exist_ok=True)
    (bundle / ROOTFS).mkdir(mode=0o700, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps(config))
    (bundle / "pid").unlink(missing_ok=True)
    linux = config["linux"]
    assert isinstance(linux, dict)
    return any(ns.get("type") == "network" for ns in linux["namespaces"])


async def remove(name: str, *, home: Path, cgroup: str) -> None:
    """Kill the sandbox ``name`` and delete its runsc state, cgroup and bundle;
    idempotent (a sandbox runsc does not know is gone)."""
    state = home / "state"
    if await asyncio.to_thread(state.is_dir):
        await run(*runsc_argv(state, networked=False), "delete", "--force", name, check=False)
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


def release_home(home: Path) -> None:
    """Remove runsc's directories once no sandbox uses them (the node stops)."""
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
