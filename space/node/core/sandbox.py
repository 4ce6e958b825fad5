"""One sandbox's live parts on the node: its record, guest, guest channel and watcher.

For the node agent (space.node.agent), which owns the lifecycle and the locking; this
module knows how to bring a sandbox's guest up, reconnect to it and take it apart.
The guest is a QEMU VM (QemuVM) or a gVisor sandbox (GvisorGuest, issue 21): both
start, give a guest channel, are watched, pause, save their state into the volume and
stop alike (a gVisor sandbox by runsc pause and checkpoint, and it starts again from
that state by runsc restore); moves are QEMU's only so far, and ``check_memory_ops``
refuses them for gVisor before anything is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from space.node.api import Conflict, NodeError, SandboxState, Timeout, Unavailable
from space.node.channel import GuestChannel
from space.node.core.keys import NodeKeys
from space.node.core.run import command_lines
from space.node.core.state import Pending, SandboxRecord
from space.node.network import netns
from space.node.vmm.accel import Accelerator
from space.node.vmm.gvisor import GvisorConfig, GvisorGuest
from space.node.vmm.gvisor import clone_tree as gvisor_clone
from space.node.vmm.qemu import QemuVM, VmConfig, console_tail, trim_console

__all__ = [
    "GVISOR_MEMORY_OPS",
    "MEMORY_FILE",
    "NIC_MARKER",
    "STATE_FILE",
    "LiveSandbox",
    "check_memory_ops",
    "fsync_file",
    "has_nic",
    "hostname_for",
    "kill_strays",
    "not_allowed",
    "preflush",
    "settled",
    "vm_config_for",
    "with_console",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

_CONSOLE_CHECK_S = 5.0
#: QEMU run states in which the vCPUs are stopped but ``cont`` runs them again.
_STOPPED_STATES = frozenset({"paused", "postmigrate", "prelaunch", "finish-migrate"})
_CONSOLE_TAIL_BYTES = 2048
#: What a gVisor sandbox does through saved memory: runsc pause, checkpoint, restore
#: (a move carries the checkpoint in its volume).
GVISOR_MEMORY_OPS = frozenset(
    {"pause", "resume", "hibernate", "snapshot", "restore", "fork", "move"}
)


def hostname_for(sandbox_id: str) -> str:
    """A valid hostname derived from the sandbox id (lowercase, [a-z0-9-], <= 63)."""
    name = re.sub(r"[^a-z0-9-]+", "-", sandbox_id.lower()).strip("-")[:63].strip("-")
    return name or "sandbox"


#: Files in a sandbox volume next to kernel, initrd and rootfs.img, present while it is
#: a memory image (hibernated, a snapshot, a ready state): the saved VM state, with the
#: guest RAM in it, or beside it in the RAM file (a ready state, and images saved before
#: guest RAM was private). A running VM's RAM is in no file of its volume.
MEMORY_FILE = "memory.ram"
STATE_FILE = "vmstate"
#: Present in a volume whose VM has a NIC. A saved VM must be woken with the devices it
#: was saved with, and volumes saved before sandboxes had networks have none.
NIC_MARKER = "nic"


def has_nic(volume: Path) -> bool:
    return (volume / NIC_MARKER).exists()


async def preflush(volume: Path) -> None:
    """Write a running VM's dirty disk pages out while it still runs.

    A btrfs snapshot flushes the source's dirty data first; done here, before the
    pause, that flush only finds the pages of the last moments. Best effort. (Public:
    bench/bench_lifecycle.py times a bare btrfs snapshot after the same flush.)
    """
    with contextlib.suppress(OSError):
        await asyncio.to_thread(fsync_file, volume / "rootfs.img")


def fsync_file(path: Path) -> None:
    """fsync one file (a VM's RAM file before a snapshot or after a state save)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def vm_config_for(
    record: SandboxRecord,
    *,
    volume: Path,
    base_cmdline: str,
    accel: Accelerator,
    console_log: Path,
    keys: NodeKeys,
) -> VmConfig:
    """The VM of a sandbox: kernel, initrd and rootfs live in its own volume; its RAM is
    anonymous until ``LiveSandbox.launch`` says otherwise."""
    spec = record.spec
    return VmConfig(
        sandbox_id=spec.sandbox_id,
        run_dir=Path(record.run_dir),
        kernel=volume / "kernel",
        initrd=volume / "initrd",
        rootfs=volume / "rootfs.img",
        kernel_cmdline=(
            f"{base_cmdline} space.hostname={hostname_for(spec.sandbox_id)} {netns.KERNEL_ARG}"
        ).strip(),
        console_log=console_log,
        cpus=spec.cpus,
        memory_mib=spec.memory_mib,
        accel=accel,
        netns=netns.netns_path(netns.netns_name(Path(record.run_dir))),
        keys=keys,
    )


@dataclass(eq=False)
class LiveSandbox:
    """A sandbox known to the node. ``lock`` serialises its lifecycle operations."""

    record: SandboxRecord
    config: VmConfig
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    vm: QemuVM | GvisorGuest | None = None
    channel: GuestChannel | None = None
    watcher: asyncio.Task[None] | None = None
    #: The egress CA certificate (PEM) installed in this guest's filesystem, if any.
    trusted_ca: bytes | None = None
    #: Whether its namespace's ruleset is open, as this process last made or set it
    #: (None: not known, as after a restart): a closed one is not closed again.
    ruleset_open: bool | None = None
    #: Why the node stopped this VM itself (its guest abused the channel), if it did:
    #: the reason its exit is reported with, and no new channel is opened to it.
    fault: str | None = None
    #: Until when (time.monotonic) the sandbox is held still for a move (issue 19):
    #: exported, not to be woken, restored or exported again meanwhile.
    held_until: float | None = None
    _stopping: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    @property
    def volume(self) -> Path:
        return self.config.rootfs.parent

    @property
    def state_file(self) -> Path:
        return self.volume / STATE_FILE

    @property
    def has_network(self) -> bool:
        """Whether the sandbox has a network its egress policy governs (NIC_MARKER): a
        VM with a NIC, a gVisor sandbox with its link (every one made since it had)."""
        return has_nic(self.volume)

    @property
    def vm_alive(self) -> bool:
        return self.vm is not None and self.vm.alive

    async def launch(
        self,
        *,
        qemu_binary: str,
        incoming: bool = False,
        memory_file: Path | None = None,
        memory_shared: bool = False,
    ) -> QemuVM:
        """Start this sandbox's QEMU (``incoming``: paused, waiting for a saved state),
        its RAM mapped from ``memory_file`` if given (see VmConfig).

        A VM booted afresh gets a NIC in its own network namespace (made here, closed
        until the egress policy opens it); a saved VM gets one only if it had one.
        """
        config = replace(
            self.config,
            incoming=incoming,
            memory_file=memory_file,
            memory_shared=memory_shared,
        )
        if not incoming:
            (self.volume / NIC_MARKER).touch()
        if config.netns is not None and has_nic(self.volume):
            if await netns.create(config.run_dir.parent, config.netns.name):
                self.ruleset_open = False
        else:
            config = replace(config, netns=None)
        self.vm = await QemuVM.launch(config, qemu_binary=qemu_binary)
        return self.vm

    async def launch_gvisor(self, *, tree: Path, run_root: Path) -> GvisorGuest:
        """Start this sandbox as a gVisor sandbox: its volume a fresh clone of the
        template's directory ``tree``, its link in its own network namespace (made here,
        closed until the egress policy opens it), as QEMU's ``launch`` does for a VM."""
        await gvisor_clone(run_root, tree, self.volume)
        await asyncio.to_thread((self.volume / NIC_MARKER).touch)
        return await self.restore_gvisor(run_root=run_root, state=None)

    async def restore_gvisor(self, *, run_root: Path, state: Path | None) -> GvisorGuest:
        """Start this gVisor sandbox on its volume as it is, from the checkpoint
        ``state`` (in its volume) if given: running, on a new channel."""
        config = self._gvisor_config(run_root)
        if config.netns is not None and await netns.create(
            self.config.run_dir.parent, config.netns, veth=config.networked
        ):
            self.ruleset_open = False
        self.vm = await GvisorGuest.launch(config, state=state)
        return self.vm

    async def reattach(self, run_root: Path, pid: int) -> None:
        """Take over this sandbox's running guest, VMM ``pid`` (a restarted node's).
        Raises NodeError (Unavailable) if it is gone."""
        if self.record.guest == "gvisor":
            self.vm = await GvisorGuest.adopt(self._gvisor_config(run_root), pid)
        else:
            self.vm = await QemuVM.adopt(self.config, pid)

    def _gvisor_config(self, run_root: Path) -> GvisorConfig:
        record, keys = self.record, self.config.keys
        return GvisorConfig(
            name=Path(record.run_dir).name,
            run_root=run_root,
            volume=self.volume,
            netns=self.config.netns.name if self.config.netns is not None else None,
            hostname=hostname_for(record.sandbox_id),
            cpus=record.spec.cpus,
            memory_mib=record.spec.memory_mib,
            log=self.config.console_log,
            state_key=keys.state_key if keys is not None else None,
            networked=has_nic(self.volume),
        )

    async def save_state(self) -> int:
        """Pause the VM and save its state into the volume, which becomes a complete
        memory image; returns the state's size. The VM stays paused.

        Unless the RAM is a shared file mapping, the state holds all of it, and a RAM
        file in the volume (a copy of the image the VM was woken from) is removed: the
        volume's image is the state alone. A VM mapping that file keeps it until it
        exits.
        """
        vm = self._running_vm()
        await vm.pause()
        size = await vm.save_state(self.state_file)
        if isinstance(vm, GvisorGuest):
            return size
        if not vm.config.memory_shared:
            (self.volume / MEMORY_FILE).unlink(missing_ok=True)
        return size

    def console_tail(self) -> str:
        return console_tail(self.config.console_log, _CONSOLE_TAIL_BYTES)

    async def connect(self, *, hello_timeout_s: float) -> GuestChannel:
        """Open a fresh guest channel (a new HELLO, a new guest session).

        A guest that abuses the channel gets its VM killed (``fault`` says why); the
        watcher then reports the exit as for any VM that exits unasked.
        """
        if self.fault is not None:
            raise Unavailable(self.fault, sandbox_id=self.sandbox_id)
        if self.vm is None or not self.vm.alive:
            raise Unavailable("the sandbox's VM is not running", sandbox_id=self.sandbox_id)
        reader, writer = await self.vm.open_agent()
        try:
            channel = await GuestChannel.open(
                reader,
                writer,
                sandbox_id=self.sandbox_id,
                hello_timeout_s=hello_timeout_s,
                on_abuse=self._on_channel_abuse,
            )
        except BaseException:
            writer.close()
            raise
        self.channel = channel
        return channel

    def adopt(self, channel: GuestChannel) -> None:
        """Take over ``channel``, open to this sandbox's VM (a pool VM handed over)."""
        channel.reassign(self.sandbox_id, on_abuse=self._on_channel_abuse)
        self.channel = channel

    def _on_channel_abuse(self, reason: str) -> None:
        """The guest abused its channel (already closed): an errored sandbox's VM must
        not keep burning a core, so it is killed; the watcher reports the exit."""
        self.fault = reason
        log.warning("sandbox %s: %s; stopping its VM", self.sandbox_id, reason)
        vm = self.vm
        if vm is not None and vm.alive and self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(
                self._kill(vm), name=f"abuse-{self.sandbox_id}"
            )

    async def _kill(self, vm: QemuVM | GvisorGuest) -> None:
        try:
            await vm.kill()
        except NodeError as exc:
            log.error("sandbox %s: killing its VM failed: %s", self.sandbox_id, exc)

    async def pause(self) -> None:
        """Stop the vCPUs (a gVisor sandbox's tasks); returns once QEMU (runsc)
        confirmed. Unavailable if it cannot."""
        await self._running_vm().pause()

    async def resume(self) -> None:
        """Restart the vCPUs; returns once QEMU confirmed. Unavailable if it cannot."""
        await self._running_vm().resume()

    async def vm_is_paused(self) -> bool:
        """Whether QEMU's vCPUs are stopped, by QMP ``query-status``.

        Without a working QMP connection, or for a gVisor sandbox, the persisted
        record is believed instead.
        """
        try:
            vm = self._running_vm()
            if isinstance(vm, QemuVM):
                return await vm.query_status() in _STOPPED_STATES
        except Unavailable:
            pass
        return self.record.state == SandboxState.PAUSED

    def _running_vm(self) -> QemuVM | GvisorGuest:
        if self.vm is None or not self.vm.alive:
            raise Unavailable("the sandbox's VM is not running", sandbox_id=self.sandbox_id)
        return self.vm

    def watch(self, on_exit: Callable[[LiveSandbox], None], console_max_bytes: int) -> None:
        """Start the watcher: keeps the console bounded, reports an unexpected exit."""
        self.watcher = asyncio.create_task(
            self._watch(on_exit, console_max_bytes), name=f"watch-{self.sandbox_id}"
        )

    async def _watch(self, on_exit: Callable[[LiveSandbox], None], console_max_bytes: int) -> None:
        vm = self.vm
        if vm is None:
            return
        while vm.alive:
            trim_console(self.config.console_log, console_max_bytes)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CONSOLE_CHECK_S):
                    await vm.wait_exited()
        on_exit(self)

    async def teardown(self) -> None:
        """Stop the watcher, close the channel, stop QEMU (quit, TERM, KILL); idempotent."""
        await self.unwatch()
        if self.vm is not None:
            vm, self.vm = self.vm, None
            await vm.stop()

    async def disconnect(self) -> None:
        """Stop watching and drop channel and QMP; QEMU (runsc) keeps running."""
        await self.unwatch()
        if self.vm is not None:
            await self.vm.detach()

    async def unwatch(self) -> None:
        """Stop the watcher and close the guest channel; QEMU and QMP stay."""
        if self.watcher is not None:
            watcher, self.watcher = self.watcher, None
            if watcher is not asyncio.current_task():
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
        if self.channel is not None:
            channel, self.channel = self.channel, None
            with contextlib.suppress(NodeError, OSError):
                await channel.close()

    def mark(
        self, state: SandboxState, *, error: str | None = None, pending: Pending | None = None
    ) -> SandboxRecord:
        """Set the record's state (and the VM's pid, if it runs); returns the record."""
        pid = self.vm.pid if self.vm is not None and self.vm.alive else None
        record = self.record.with_state(state, vmm_pid=pid, error=error)
        self.record = replace(record, pending=pending)
        return self.record


async def kill_strays(
    run_root: Path, expected: dict[str, int | None], say: Callable[[str], None]
) -> None:
    """Kill QEMUs of this node (sockets under ``run_root``) that no record names by pid.

    ``expected`` maps run directory names (a sandbox's id, or the pool VM it was made
    from) to the pid its record names.
    """
    for pid, name in _qemus_under(run_root):
        if expected.get(name) == pid:
            continue
        say(f"killing stray qemu pid {pid} ({name})")
        with contextlib.suppress(NodeError):
            vm = await QemuVM.adopt(_vm_config_stub(run_root, name), pid)
            await vm.kill()


def _qemus_under(run_root: Path) -> list[tuple[int, str]]:
    """(pid, sandbox id) of every process whose command line has a socket in run_root."""
    marker = f"path={run_root}/".encode()
    found = []
    for pid, argv in command_lines():
        if marker in argv:
            sid = argv.split(marker, 1)[1].split(b"/", 1)[0].decode(errors="replace")
            found.append((pid, sid))
    return found


def _vm_config_stub(run_root: Path, sandbox_id: str) -> VmConfig:
    """Enough of a VmConfig to recognise and stop a QEMU by its sockets."""
    return VmConfig(
        sandbox_id=sandbox_id,
        run_dir=run_root / sandbox_id,
        kernel=Path(),
        initrd=Path(),
        rootfs=Path(),
        kernel_cmdline="",
        console_log=Path("/dev/null"),
    )


async def settled(transition: Awaitable[T]) -> T:
    """Run ``transition`` to its end even if the caller is cancelled meanwhile.

    Every lifecycle transition records its steps; abandoning one half-way would leave
    the record and the VM disagreeing until the next node start.
    """
    task = asyncio.ensure_future(transition)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # the cancellation is what the caller gets
            await task
        raise


def check_memory_ops(operation: str, sandbox: LiveSandbox) -> None:
    """Raise Conflict if ``operation`` goes through saved memory (pause, resume,
    hibernate, snapshot, restore, fork, a move) and the sandbox's guest type has no
    such path; checked before anything is recorded."""
    guest = sandbox.record.guest
    if guest == "qemu" or (guest == "gvisor" and operation in GVISOR_MEMORY_OPS):
        return
    raise Conflict(
        f"cannot {operation} sandbox {sandbox.sandbox_id}: "
        f"a {guest} sandbox does not support it yet",
        sandbox_id=sandbox.sandbox_id,
    )


def check_not_held(operation: str, sandbox: LiveSandbox) -> None:
    """Raise Conflict if the sandbox is held still for a move (issue 19)."""
    if sandbox.held_until is not None and time.monotonic() < sandbox.held_until:
        raise Conflict(
            f"cannot {operation} sandbox {sandbox.sandbox_id}: it is being moved",
            sandbox_id=sandbox.sandbox_id,
        )


def not_allowed(operation: str, sandbox: LiveSandbox) -> Conflict:
    state = sandbox.record.state.value
    return Conflict(
        f"cannot {operation} sandbox {sandbox.sandbox_id}: it is {state}",
        sandbox_id=sandbox.sandbox_id,
    )


def with_console(exc: BaseException, sandbox_id: str, tail: str) -> BaseException:
    """The error to raise for a failed boot: a node error carrying the console tail.

    Cancellation and node errors that are not about the VM (bad arguments) pass as is.
    """
    if not isinstance(exc, Exception):
        return exc
    if isinstance(exc, NodeError):
        if not isinstance(exc, Unavailable | Timeout):
            return exc
        return type(exc)(f"{exc.message}; console tail:\n{tail[-1500:]}", sandbox_id=sandbox_id)
    return Unavailable(
        f"{type(exc).__name__}: {exc}; console tail:\n{tail[-1500:]}", sandbox_id=sandbox_id
    )
