"""gVisor sandboxes on the node: ``runsc`` running spaced on a template's directory tree.

The counterpart of QemuVM (space.node.vmm.qemu) for the ``gvisor`` guest type (issue
21). Root does the starting and stopping (space.node.privileged._gvisor: runsc needs
it, and it decides the container's whole shape); this side hands over one end of a
socket pair as the guest's stdin and stdout, gives the other to the sandbox's channel
relay (space.node.vmm.gvisor_relay), a process of the agent's that outlives it as QEMU
does, and watches the sandbox's processes. The guest channel (the same protocol as a
VM's virtio-serial port) is a connection to the relay's socket in the run directory:
made again after a node restart (``adopt``), as a VM's is.

``runsc run --detach`` leaves its sandbox and file server (gofer) processes orphaned,
so they become children of the node, a child subreaper (space.node.vmm.jail): each is
watched by a pidfd and reaped when it exits, without which runsc's own delete would
wait forever for the zombie of the sandbox it killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from space.node.api import NodeError, Unavailable
from space.node.core.run import command_lines
from space.node.privileged import broker_for
from space.node.privileged.requests import (
    CheckpointGvisor,
    CloneGuestTree,
    LaunchGvisor,
    PauseGvisor,
    StopGvisor,
)
from space.node.vmm.state_io import state_reader, state_writer

__all__ = [
    "RUNSC",
    "GvisorConfig",
    "GvisorGuest",
    "clone_tree",
    "gvisor_names",
    "runsc_available",
    "runsc_home",
    "stop_by_name",
]

log = logging.getLogger(__name__)

#: How long a stop waits for the sandbox's processes and relay to end.
_EXIT_WAIT_S = 5.0
#: How long a saved state's stream may take to close once root handed it all over.
_SAVE_TIMEOUT_S = 60.0
#: The runsc the root broker runs (Debian's package; space.node.privileged._gvisor).
RUNSC = "runsc"
#: The channel relay's socket in the sandbox's run directory.
CHANNEL_SOCKET = "channel.sock"
_RELAY = "space.node.vmm.gvisor_relay"
#: The relay's descriptors: the guest's end and its listening socket.
_RELAY_FDS = (3, 4)


def runsc_available() -> bool:
    """Whether this host can run gVisor sandboxes (runsc is installed)."""
    return shutil.which(RUNSC) is not None


def runsc_home(run_root: Path) -> Path:
    """Where the broker keeps runsc's state and bundles for the node of ``run_root``."""
    return run_root / ".runsc"


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
    #: The node's key of saved states (space.node.core.keys): a checkpoint is sealed
    #: under it as a VM's state is (None: plaintext, as without keys for QEMU).
    state_key: bytes | None = field(default=None, repr=False)
    #: gVisor's network stack on the guest's link beside ``netns`` (its egress governed
    #: there as a VM's), rather than loopback only.
    networked: bool = False

    @property
    def bundle(self) -> Path:
        return runsc_home(self.run_root) / "bundles" / self.name

    @property
    def channel_socket(self) -> Path:
        return self.run_root / self.name / CHANNEL_SOCKET


class GvisorGuest:
    """A running gVisor sandbox. Create with ``launch`` (or take over a running one
    with ``adopt``); end with ``stop``, or leave it running with ``detach``."""

    def __init__(self, cfg: GvisorConfig, pid: int) -> None:
        self.config = cfg
        self.pid = pid
        self._exited = asyncio.get_running_loop().create_future()
        self._pidfds: dict[int, int] = {}
        self._all_exited = asyncio.Event()

    @classmethod
    async def launch(cls, cfg: GvisorConfig, *, state: Path | None = None) -> GvisorGuest:
        """Start the sandbox; returns once runsc started its init (spaced may still be
        starting). With ``state`` (a file ``save_state`` wrote) the sandbox is restored
        from it instead: the same processes and memory, on a new channel, running.
        Raises Unavailable with runsc's words (or the state's: it does not
        authenticate); nothing is left then."""
        await asyncio.to_thread(_own_log, cfg.log)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            relay = await asyncio.to_thread(_start_relay, cfg, ours)
        except BaseException:
            theirs.close()
            raise
        finally:
            ours.close()
        request = LaunchGvisor(
            name=cfg.name,
            volume=str(cfg.volume),
            netns=cfg.netns,
            hostname=cfg.hostname,
            memory_mib=cfg.memory_mib,
            cpus=cfg.cpus,
            log=str(cfg.log),
            restore=state is not None,
            networked=cfg.networked,
        )
        try:
            pid = await _start(cfg, request, theirs.fileno(), state)
        except BaseException:
            await asyncio.to_thread(_end_relay, relay)
            raise
        finally:
            theirs.close()
        guest = cls(cfg, pid)
        try:
            guest._watch_all(relay)
        except BaseException:
            await guest.stop()
            raise
        return guest

    @classmethod
    async def adopt(cls, cfg: GvisorConfig, pid: int) -> GvisorGuest:
        """Take over the running sandbox whose runsc sandbox process is ``pid`` (a
        restarted node's); raises Unavailable if it or its channel relay is gone."""
        processes = await asyncio.to_thread(_processes_of, cfg.bundle)
        relays = await asyncio.to_thread(_relays_of, cfg.channel_socket)
        if pid not in processes or not relays:
            raise Unavailable("its runsc or its channel relay is gone", sandbox_id=cfg.name)
        guest = cls(cfg, pid)
        guest._watch_all(*relays)
        return guest

    def _watch_all(self, *more: int) -> None:
        """Watch the sandbox's runsc processes and ``more`` (its relay)."""
        self._watch(self.pid)
        for other in (*_processes_of(self.config.bundle), *more):
            if other != self.pid:
                self._watch(other)

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
        """A guest channel: a connection to the relay, which passes it spaced's
        frames from its answer to this connection's HELLO on. A newer one replaces
        it. Raises Unavailable if the relay is gone."""
        try:
            return await asyncio.open_unix_connection(self.config.channel_socket)
        except OSError as exc:
            raise Unavailable(
                f"the sandbox's channel relay is gone: {exc}", sandbox_id=self.config.name
            ) from None

    async def pause(self) -> None:
        """Stop the sandbox's tasks (``runsc pause``); its memory and channel stay.
        Idempotent. Raises Unavailable."""
        await broker_for(self.config.run_root).call(PauseGvisor(name=self.config.name, paused=True))

    async def resume(self) -> None:
        """Let the sandbox's tasks go on (``runsc resume``); idempotent."""
        request = PauseGvisor(name=self.config.name, paused=False)
        await broker_for(self.config.run_root).call(request)

    async def save_state(self, path: Path, *, timeout_s: float = _SAVE_TIMEOUT_S) -> int:
        """Checkpoint the sandbox into ``path``, sealed under the node's state key as a
        VM's state is (space.node.vmm.state_io): root copies runsc's checkpoint into
        the sealer's pipe. The sandbox stays as it was, running or paused (pause it
        first for a state that matches its files). Returns the file's size. Raises
        Unavailable or Timeout; ``path`` is then incomplete (a sealed one never
        authenticates)."""
        sid = self.config.name
        async with state_writer(path, self.config.state_key, sandbox_id=sid) as writer:
            request = CheckpointGvisor(name=sid)
            await broker_for(self.config.run_root).call(request, fds=(writer.qemu_fd,))
            writer.handed_over()
            return await writer.finish(timeout_s)

    async def stop(self) -> None:
        """Kill the sandbox and remove runsc's state of it; idempotent. Every process
        of it is reaped before this returns (runsc waits for that itself)."""
        try:
            await broker_for(self.config.run_root).call(StopGvisor(name=self.config.name))
        finally:
            await self.detach(exiting=True)
            await asyncio.to_thread(reap_runsc_orphans)

    async def kill(self) -> None:
        await self.stop()

    async def detach(self, *, exiting: bool = False) -> None:
        """Drop the exit watches; the sandbox and its relay keep running (the next
        node adopts them). ``exiting`` (after a stop): its processes are waited for a
        moment and reaped, or they would stay this process's zombies, which runsc's
        delete (a restarted node's, in the same process) waits for forever."""
        if exiting and self._pidfds:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_EXIT_WAIT_S):
                    await self._all_exited.wait()
        for pid in list(self._pidfds):
            pidfd = self._pidfds.pop(pid)
            asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)
            _reap(pid)


async def _start(cfg: GvisorConfig, request: LaunchGvisor, channel: int, state: Path | None) -> int:
    """Ask root to start (or, with ``state``, restore) the sandbox; its pid."""
    broker = broker_for(cfg.run_root)
    if state is None:
        pid = await broker.call(request, fds=(channel,))
    else:
        async with state_reader(state, cfg.state_key, sandbox_id=cfg.name) as reader:
            try:
                pid = await broker.call(request, fds=(channel, reader.qemu_fd))
            except NodeError:
                reader.check()  # a chunk that did not authenticate is why it failed
                raise
            reader.handed_over()
            await reader.finish(_SAVE_TIMEOUT_S)
    assert isinstance(pid, int)
    return pid


def _start_relay(cfg: GvisorConfig, guest_end: socket.socket) -> int:
    """Start the sandbox's channel relay on ``guest_end``, listening on the run
    directory's socket (bound here, so it takes connections before the relay runs),
    in a session of its own and no child this process keeps (a node that ends leaves
    it running); its pid."""
    path = cfg.channel_socket
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # the relay of an earlier run (before a restore) ended
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(2)
        # Copies above the target numbers, so each dup2 in the child makes a new fd
        # (one that keeps close-on-exec otherwise); closed here once it runs.
        high = [
            fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
            for fd in (guest_end.fileno(), listener.fileno())
        ]
        try:
            null = os.devnull
            return os.posix_spawn(
                sys.executable,
                [sys.executable, "-P", "-m", _RELAY, *map(str, _RELAY_FDS), str(path)],
                dict(os.environ),
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, null, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_OPEN, 1, null, os.O_WRONLY, 0),
                    (os.POSIX_SPAWN_OPEN, 2, null, os.O_WRONLY, 0),
                    *(
                        (os.POSIX_SPAWN_DUP2, fd, to)
                        for fd, to in zip(high, _RELAY_FDS, strict=True)
                    ),
                ],
                setsid=True,
            )
        finally:
            for fd in high:
                os.close(fd)


def _end_relay(pid: int) -> None:
    """Kill and reap a relay whose sandbox did not start."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _relays_of(channel_socket: Path) -> list[int]:
    """Pids of the relays listening on ``channel_socket`` (one, or none once gone)."""
    marker = f"\0{channel_socket}\0".encode()
    return [pid for pid, argv in command_lines() if _RELAY.encode() in argv and marker in argv]


def _own_log(log: Path) -> None:
    """Make ``log`` a file of the agent's, for root to append runsc's output to. runsc
    hands its stdio to the container's user (root in the sandbox), the log included:
    one left by an earlier run of the sandbox (before a hibernate or restore) is kept
    as the ``.old`` log and a new one started."""
    try:
        log.touch(mode=0o600)
    except PermissionError:
        log.replace(log.with_suffix(".old"))
        log.touch(mode=0o600)


def reap_runsc_orphans() -> None:
    """Reap the exited runsc processes this process adopted as the jails' subreaper
    and watches no pidfd of: the two helpers a ``runsc delete`` re-executes (named
    ``exe``) are left to it at every stop of a gVisor sandbox (a checkpoint leaves
    none), and would stay its zombies for good. Only zombies named ``exe`` are taken:
    runsc is only ever started by the root broker, so no child this process waits for
    itself has that name."""
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                line = stat.read()
        except OSError:
            continue
        name, _, rest = line.partition(b" (")[2].rpartition(b") ")
        fields = rest.split()
        if name == b"exe" and fields[:1] == [b"Z"] and fields[1:2] == [str(me).encode()]:
            _reap(int(entry.name))


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
        await asyncio.to_thread(reap_runsc_orphans)


def gvisor_names(run_root: Path) -> set[str]:
    """Names of the gVisor sandboxes the node of ``run_root`` has runsc processes or a
    mounted bundle for (a stray among them once no record names it): read from command
    lines and the mount table, as the bundles themselves are root's."""
    bundles = f"{runsc_home(run_root)}/bundles/"
    flag = f"--bundle={bundles}".encode()
    names = {
        argv.split(flag, 1)[1].split(b"\0", 1)[0].decode(errors="replace")
        for _, argv in command_lines()
        if argv.startswith(b"runsc") and flag in argv
    }
    with open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts:
        for line in mounts:
            target = line.split()[1]
            if target.startswith(bundles):
                names.add(target.removeprefix(bundles).split("/", 1)[0])
    return names


def _processes_of(bundle: Path) -> list[int]:
    """Pids of the runsc processes serving ``bundle`` (its sandbox and gofer)."""
    marker = f"--bundle={bundle}\0".encode()
    return [pid for pid, argv in command_lines() if argv.startswith(b"runsc-") and marker in argv]
