"""gVisor sandboxes on the node: ``runsc`` running spaced on a template's directory tree.

The counterpart of QemuVM (space.node.vmm.qemu) for the ``gvisor`` guest type (issue
21). Root does the starting and stopping (space.node.privileged._gvisor: runsc needs
it, and it decides the container's whole shape); this side hands over one end of a
socket pair as the guest's stdin and stdout, keeps the other as the guest channel (the
same protocol as a VM's virtio-serial port), and watches the sandbox's processes.

``runsc run --detach`` leaves its sandbox and file server (gofer) processes orphaned,
so they become children of the node, a child subreaper (space.node.vmm.jail): each is
watched by a pidfd and reaped when it exits, without which runsc's own delete would
wait forever for the zombie of the sandbox it killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from space.node.api import InvalidArgument, NodeError, Unavailable
from space.node.core.run import command_lines
from space.node.privileged import broker_for
from space.node.privileged.requests import (
    CloneGuestTree,
    LaunchGvisor,
    MakeGuestTree,
    StopGvisor,
)
from space.node.storage.disks import disk_format

__all__ = [
    "RUNSC",
    "GvisorConfig",
    "GvisorGuest",
    "clone_tree",
    "ensure_tree",
    "runsc_available",
    "runsc_home",
    "stop_by_name",
]

log = logging.getLogger(__name__)

#: How long a detach waits for a sandbox whose channel closed to end.
_EXIT_WAIT_S = 5.0
#: The runsc the root broker runs (Debian's package; space.node.privileged._gvisor).
RUNSC = "runsc"


def runsc_available() -> bool:
    """Whether this host can run gVisor sandboxes (runsc is installed)."""
    return shutil.which(RUNSC) is not None


def runsc_home(run_root: Path) -> Path:
    """Where the broker keeps runsc's state and bundles for the node of ``run_root``."""
    return run_root / ".runsc"


async def ensure_tree(run_root: Path, image_dir: Path, tree: Path) -> None:
    """Make ``tree`` (a subvolume, root's) the directory tree of the guest image
    built in ``image_dir`` (the image cache's entry of a template's digest), unless it
    exists: once per template. The image is the plain ext4 the node imported before
    encrypting it (space.node.storage.disks); it reaches root as a descriptor opened
    here. Raises InvalidArgument if there is no such image (a built template)."""
    fd = await asyncio.to_thread(_open_plain_image, image_dir, tree)
    if fd is None:
        return
    try:
        await broker_for(run_root).call(MakeGuestTree(path=str(tree)), fds=(fd,))
    finally:
        os.close(fd)


def _open_plain_image(image_dir: Path, tree: Path) -> int | None:
    """The plain image of ``image_dir``, open; None if ``tree`` exists already."""
    if tree.is_dir():
        return None
    image = image_dir / "rootfs.img"
    if not image.is_file() or disk_format(image) != "raw":
        raise InvalidArgument(f"no plain guest image in {image_dir} to make a gVisor tree of")
    tree.parent.mkdir(mode=0o700, exist_ok=True)
    return os.open(image, os.O_RDONLY | os.O_CLOEXEC)


async def clone_tree(run_root: Path, tree: Path, volume: Path) -> None:
    """Make ``volume`` (absent) a copy-on-write snapshot of ``tree``."""
    await broker_for(run_root).call(CloneGuestTree(tree=str(tree), volume=str(volume)))


@dataclass(frozen=True, slots=True)
class GvisorConfig:
    """One gVisor sandbox: its name (its run directory's), root filesystem (a clone of
    a template's tree), network namespace (None: no network), resources and log."""

    name: str
    run_root: Path
    volume: Path
    netns: str | None
    hostname: str
    cpus: int
    memory_mib: int
    log: Path

    @property
    def bundle(self) -> Path:
        return runsc_home(self.run_root) / "bundles" / self.name


class GvisorGuest:
    """A running gVisor sandbox. Create with ``launch``; end with ``stop``."""

    def __init__(self, cfg: GvisorConfig, pid: int, channel: socket.socket) -> None:
        self.config = cfg
        self.pid = pid
        self._channel: socket.socket | None = channel
        self._exited = asyncio.get_running_loop().create_future()
        self._pidfds: dict[int, int] = {}
        self._all_exited = asyncio.Event()

    @classmethod
    async def launch(cls, cfg: GvisorConfig) -> GvisorGuest:
        """Start the sandbox; returns once runsc started its init (spaced may still be
        starting). Raises Unavailable with runsc's words; nothing is left then."""
        # The log is the agent's own file; root only appends runsc's output to it.
        await asyncio.to_thread(cfg.log.touch, mode=0o600)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = LaunchGvisor(
            name=cfg.name,
            volume=str(cfg.volume),
            netns=cfg.netns,
            hostname=cfg.hostname,
            memory_mib=cfg.memory_mib,
            cpus=cfg.cpus,
            log=str(cfg.log),
        )
        try:
            pid = await broker_for(cfg.run_root).call(request, fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        assert isinstance(pid, int)
        guest = cls(cfg, pid, ours)
        try:
            guest._watch(pid)
            for other in _processes_of(cfg.bundle):
                if other != pid:
                    guest._watch(other)
        except BaseException:
            await guest.stop()
            raise
        return guest

    def _watch(self, pid: int) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            if pid == self.pid:
                self._on_exit(pid)
            return
        self._pidfds[pid] = pidfd
        asyncio.get_running_loop().add_reader(pidfd, self._on_exit, pid)

    def _on_exit(self, pid: int) -> None:
        pidfd = self._pidfds.pop(pid, -1)
        if pidfd >= 0:
            asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)
        _reap(pid)
        if not self._pidfds:
            self._all_exited.set()
        if pid == self.pid and not self._exited.done():
            self._exited.set_result(None)

    @property
    def alive(self) -> bool:
        return not self._exited.done()

    async def wait_exited(self) -> None:
        await asyncio.shield(self._exited)

    async def open_agent(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The guest channel: the socket spaced reads and writes. Once only: spaced
        on stdio serves one session and exits at its end (a second one needs a
        reconnectable transport, which gVisor sandboxes do not have yet)."""
        if self._channel is None:
            raise Unavailable("a gVisor sandbox's channel opens once", sandbox_id=self.config.name)
        sock, self._channel = self._channel, None
        return await asyncio.open_unix_connection(sock=sock)

    async def stop(self) -> None:
        """Kill the sandbox and remove runsc's state of it; idempotent. Every process
        of it is reaped before this returns (runsc waits for that itself)."""
        try:
            await broker_for(self.config.run_root).call(StopGvisor(name=self.config.name))
        finally:
            await self.detach()

    async def kill(self) -> None:
        await self.stop()

    async def detach(self) -> None:
        """Close the channel not taken and drop the exit watches.

        Once its channel is closed (the node closes, or the caller closed it), spaced
        ends at EOF and with it the sandbox: its processes are waited for a moment and
        reaped, or they would stay this process's zombies, which runsc's delete (a
        restarted node's, in the same process) waits for forever."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._pidfds:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_EXIT_WAIT_S):
                    await self._all_exited.wait()
        for pid in list(self._pidfds):
            pidfd = self._pidfds.pop(pid)
            asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)
            _reap(pid)


def _reap(pid: int) -> None:
    """Collect ``pid``'s exit status if it is this process's child (an orphan of runsc
    adopted by the subreaper) and has exited."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


async def stop_by_name(run_root: Path, name: str) -> None:
    """Kill the gVisor sandbox ``name`` whatever this process knows of it (a node
    restarted: its sandboxes do not survive that yet); idempotent, logs failures.

    Its processes may be this process's children still (a node restarted in the same
    process, as tests do): they are reaped as they exit, or runsc's delete would wait
    for a zombie."""
    loop = asyncio.get_running_loop()
    watched: dict[int, int] = {}

    def exited(pid: int) -> None:
        pidfd = watched.pop(pid)
        loop.remove_reader(pidfd)
        os.close(pidfd)
        _reap(pid)

    bundle = runsc_home(run_root) / "bundles" / name
    for pid in await asyncio.to_thread(_processes_of, bundle):
        with contextlib.suppress(OSError):
            watched[pid] = os.pidfd_open(pid)
            loop.add_reader(watched[pid], exited, pid)
    try:
        await broker_for(run_root).call(StopGvisor(name=name))
    except NodeError as exc:
        log.error("gVisor sandbox %s: stopping it failed: %s", name, exc)
    finally:
        for pid, pidfd in list(watched.items()):
            loop.remove_reader(pidfd)
            os.close(pidfd)
            _reap(pid)


def _processes_of(bundle: Path) -> list[int]:
    """Pids of the runsc processes serving ``bundle`` (its sandbox and gofer)."""
    marker = f"--bundle={bundle}\0".encode()
    return [pid for pid, argv in command_lines() if argv.startswith(b"runsc-") and marker in argv]
