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
import shutil
from pathlib import Path

from space.node.api import InvalidArgument, Unavailable
from space.node.core.run import run
from space.node.network.netns import netns_path
from space.node.privileged.pinned import Pinned

__all__ = [
    "GUEST_PROCESS",
    "OVERHEAD_MIB",
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
_CGROUP_ROOT = Path("/sys/fs/cgroup")


async def make_tree(image_fd: int, parent: Pinned) -> None:
    """Unpack the ext4 image open as ``image_fd`` into the subvolume ``parent.name``
    of the directory ``parent`` holds; a no-op if it exists. Built under a temporary
    name and renamed, so a tree that exists is complete.

    ``debugfs rdump`` reads the image without mounting it and, run as root, keeps
    every file's owner and mode.
    """
    assert parent.name is not None
    final = Path(parent.path)
    staging = final.with_name(f".{parent.name}.building")
    if await asyncio.to_thread(final.exists):
        return
    if await asyncio.to_thread(staging.exists):
        await run("btrfs", "subvolume", "delete", str(staging), check=False)
    await run("btrfs", "subvolume", "create", str(staging))
    try:
        out = await run(
            "debugfs", "-R", f"rdump / {staging}", f"/proc/{os.getpid()}/fd/{image_fd}",
            timeout_s=300.0,
        )  # fmt: skip
        await asyncio.to_thread(_publish, staging, final, out)
    except BaseException:
        await run("btrfs", "subvolume", "delete", str(staging), check=False)
        raise


def _publish(staging: Path, final: Path, debugfs_out: str) -> None:
    """Check an unpacked tree and give it its final name (what exists is complete)."""
    if "rdump:" in debugfs_out or not (staging / "usr" / "bin" / "python3").exists():
        raise Unavailable(f"unpacking the guest image failed: {debugfs_out[-500:]}")
    os.chmod(staging, 0o755)
    os.rename(staging, final)


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
    channel_fd: int,
    log: Pinned,
    owner: tuple[int, int],
) -> int:
    """Start the sandbox ``name`` (``config``: ``oci_config``'s) with ``channel_fd``
    as its init's stdin and stdout; returns the pid of its runsc sandbox process,
    which lives as long as the sandbox. ``home`` holds runsc's state and bundles.
    ``log`` must be a file of the agent's (``owner``): runsc's output goes to a file
    the agent reads, never to one root opened for it elsewhere.
    Raises Unavailable (runsc's own words); nothing is left running then.
    """
    log_fd = await asyncio.to_thread(_open_log, log, owner)
    cgroup = str(config["linux"]["cgroupsPath"])  # type: ignore[index]
    try:
        bundle = home / "bundles" / name
        networked = await asyncio.to_thread(_write_bundle, bundle, config)
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
    await asyncio.to_thread(_remove_rest, home / "bundles" / name, cgroup)


def _remove_rest(bundle: Path, cgroup: str) -> None:
    """The bundle, and the cgroup a runsc that failed half-way left (runsc's delete
    removes it only for a container it made): empty once its processes are gone."""
    shutil.rmtree(bundle, ignore_errors=True)
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
