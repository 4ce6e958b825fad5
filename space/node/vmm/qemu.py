"""One QEMU process per sandbox: command line, launch, re-adoption, QMP, stop.

QEMU outlives the node agent (a restarted agent re-adopts it): it is spawned in its own
session with stdio on files, never pipes, and is found again by pid plus a check that
``/proc/<pid>/cmdline`` names this sandbox's agent socket. Exit is watched through a
pidfd, which also makes signals immune to pid reuse.

Every public method raises space.node.api.errors leaves (Unavailable, Timeout), never
OSError or a QMP exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from qemu.qmp import QMPClient

from space.node.api import NodeError, Timeout, Unavailable
from space.node.core.keys import NodeKeys
from space.node.network.netns import GUEST_MAC, TAP
from space.node.storage.disks import DiskFormat, disk_format
from space.node.vmm.accel import Accelerator
from space.node.vmm.jail import JAIL_SECRETS, TAP_FD, Bind, jail_for
from space.node.vmm.state_io import state_reader, state_writer

__all__ = [
    "TCG_CPU",
    "TCG_KERNEL_ARGS",
    "QemuVM",
    "VmConfig",
    "build_command",
    "guest_cpu",
    "jail_binds",
    "jail_owned",
    "pid_runs_vm",
]

log = logging.getLogger(__name__)

_QMP_TIMEOUT_S = 5.0
_UNTHROTTLED = 1 << 40  # bytes/s
_SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
_DISK_SECRET = "disk"
#: A TCG guest's CPU: QEMU's ``max`` less the fast-string features. Where the CPU claims
#: them (ERMS, FSRM and kin) the guest's kernel and glibc copy and clear memory with
#: ``rep movsb``/``rep stosb``, which TCG emulates a byte at a time; without them they
#: take vector loops. Measured in one guest (medians of 7): exec of ``true`` 31 -> 20
#: ms, ``python3 -c pass`` 130 -> 94 ms, writing 64 MiB 444 -> 212 ms, and a fifth less
#: host CPU over the same execs. A memory image booted with them wakes without them (the
#: guest keeps the copy routines it chose): it is only slower.
TCG_CPU = "max,-erms,-fsrm,-fzrm,-fsrs,-fsrc"
#: Appended to a TCG guest's kernel command line. At boot the kernel checks that timer
#: interrupts reach it through the IO-APIC by counting ticks over a short busy wait; a
#: TCG vCPU on a loaded host can see too few and the kernel panics ("IO-APIC + timer
#: doesn't work!", seen in the VM lane with three workers). QEMU's chipset is not the
#: broken one the check is for, and a KVM guest skips it by itself (kvmclock).
TCG_KERNEL_ARGS = "no_timer_check"


@dataclass(frozen=True, slots=True)
class VmConfig:
    """What one sandbox VM is made of. ``run_dir`` holds its sockets and pid file."""

    sandbox_id: str
    run_dir: Path
    kernel: Path
    initrd: Path
    rootfs: Path
    kernel_cmdline: str
    console_log: Path
    #: A file the guest RAM is mapped from (None: anonymous memory). Mapped private
    #: (copy on write) unless ``memory_shared``: the file is a clean memory image whose
    #: pages every VM woken from it shares through the page cache, what a guest dirties
    #: stays in its VM's anonymous memory, and nothing is ever written to the file.
    memory_file: Path | None = None
    #: Map ``memory_file`` shared: the guest's writes go to the file, and saving the
    #: VM's state writes only device state. Only for the VM a template's ready state is
    #: taken from: every page a guest dirties is then written back to disk as it runs.
    memory_shared: bool = False
    #: Start paused, waiting for ``load_state`` (QEMU's ``-incoming defer``).
    incoming: bool = False
    #: The network namespace QEMU runs in, with a tap named ``tap`` for the guest's
    #: one NIC (None: no NIC at all). The MAC is fixed: every namespace is alike.
    netns: Path | None = None
    tap: str = TAP
    mac: str = GUEST_MAC
    cpus: int = 1
    memory_mib: int = 256
    accel: Accelerator = "tcg"
    # i440fx ("pc") has fewer devices to probe than q35, so the guest boots faster.
    machine: str = "pc"
    #: The node's keys for data at rest (None: disks raw, states unencrypted; only
    #: for tools and tests of this module, every VM of a node has them).
    keys: NodeKeys | None = field(default=None, repr=False, compare=False)
    #: How ``rootfs`` is stored: ``launch`` reads it from the image itself.
    disk_format: DiskFormat = "raw"

    @property
    def qmp_socket(self) -> Path:
        return self.run_dir / "qmp.sock"

    @property
    def agent_socket(self) -> Path:
        return self.run_dir / "agent.sock"

    @property
    def pid_file(self) -> Path:
        return self.run_dir / "qemu.pid"

    @property
    def stderr_log(self) -> Path:
        return self.run_dir / "qemu.log"


def build_command(cfg: VmConfig, *, qemu_binary: str = "qemu-system-x86_64") -> list[str]:
    """The full QEMU argv for ``cfg`` (pure; no I/O)."""
    # A 64 MiB translation cache instead of TCG's default saves ~90 MiB RSS per VM
    # (measured: 334 -> 242 MiB) at no visible boot cost.
    if cfg.accel == "kvm":
        accel, cmdline = "kvm", cfg.kernel_cmdline
    else:
        accel, cmdline = "tcg,tb-size=64", f"{cfg.kernel_cmdline} {TCG_KERNEL_ARGS}".strip()
    # Always a backend named "ram": a saved state names its RAM block, so a VM whose RAM
    # is anonymous can load the state of one whose RAM was a file, and back.
    backend = f"memory-backend-ram,id=ram,size={cfg.memory_mib}M"
    if cfg.memory_file is not None:
        # A private mapping opens the file read-only (readonly=on) yet lets the guest
        # write its copy-on-write pages (rom=off, QEMU >= 8.2): a jailed QEMU gets a
        # ready state's image shared by every sandbox of a template read-only.
        mapping = "share=on" if cfg.memory_shared else "share=off,readonly=on,rom=off"
        backend = (
            f"memory-backend-file,id=ram,size={cfg.memory_mib}M,mem-path={cfg.memory_file},"
            + mapping
        )
    argv = [
        qemu_binary,
        "-name", f"space-{cfg.sandbox_id},process=space-{cfg.sandbox_id}",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-machine", f"{cfg.machine},memory-backend=ram", "-accel", accel,
        "-cpu", guest_cpu(cfg.accel),
        "-smp", str(cfg.cpus), "-m", str(cfg.memory_mib), "-object", backend,
        "-kernel", str(cfg.kernel), "-initrd", str(cfg.initrd),
        "-append", cmdline,
        *_disk(cfg),
        "-device", "virtio-blk-pci,drive=root",
        "-device", "virtio-serial-pci,id=vser",
        "-chardev", f"socket,id=agent,path={cfg.agent_socket},server=on,wait=off",
        "-device", "virtserialport,bus=vser.0,chardev=agent,name=space.agent",
        "-chardev", f"file,id=console,path={cfg.console_log},append=on",
        "-serial", "chardev:console",
        "-qmp", f"unix:{cfg.qmp_socket},server=on,wait=off",
        "-sandbox", _SECCOMP,
    ]  # fmt: skip
    if cfg.netns is not None:
        # The jail opens the sandbox's tap in its namespace and hands it over as
        # TAP_FD. romfile= skips the NIC's PXE option ROM: the kernel is booted directly.
        argv += [
            "-netdev", f"tap,id=net0,fd={TAP_FD}",
            "-device", f"virtio-net-pci,netdev=net0,mac={cfg.mac},romfile=",
        ]  # fmt: skip
    return [*argv, "-incoming", "defer"] if cfg.incoming else argv


def guest_cpu(accel: Accelerator) -> str:
    """QEMU's ``-cpu`` for a VM on ``accel``. A ready state records the one it booted
    on, and is made again under another (space.node.agent._ready)."""
    return "host" if accel == "kvm" else TCG_CPU


def _disk(cfg: VmConfig) -> list[str]:
    # werror/rerror=report: a failed write or read (the host's ENOSPC when the pool is
    # full, EDQUOT past the volume's quota group) is the guest's I/O error, and the VM
    # runs on. QEMU's default werror=enospc would pause the VM on ENOSPC until someone
    # resumes it (issue 17).
    drive = (
        f"file={cfg.rootfs},if=none,id=root,format={cfg.disk_format},werror=report,rerror=report"
    )
    if cfg.disk_format == "raw":
        return ["-drive", drive]
    # The passphrase is a file of the jail's own root (JAIL_SECRETS), never in argv.
    secret = f"secret,id=disk-key,file={JAIL_SECRETS / _DISK_SECRET},format=raw"
    return ["-object", secret, "-drive", f"{drive},key-secret=disk-key"]


def jail_binds(cfg: VmConfig) -> list[Bind]:
    """What of the host a VM's jail holds: its own files only."""
    binds = [Bind(cfg.kernel, "ro"), Bind(cfg.initrd, "ro"), Bind(cfg.rootfs, "rw")]
    binds += [Bind(cfg.console_log, "rw"), Bind(cfg.run_dir, "rw")]
    if cfg.memory_file is not None:
        binds.append(Bind(cfg.memory_file, "rw" if cfg.memory_shared else "ro"))
    if cfg.accel == "kvm":
        binds.append(Bind(Path("/dev/kvm"), "dev"))
    return binds


def jail_owned(cfg: VmConfig) -> list[Path]:
    """The files a VM's jailed uid owns: its own, never a file VMs share."""
    owned = [cfg.kernel, cfg.initrd, cfg.rootfs, cfg.console_log, cfg.run_dir]
    if cfg.memory_file is not None and cfg.memory_shared:
        owned.append(cfg.memory_file)
    return owned


def pid_runs_vm(pid: int, cfg: VmConfig) -> bool:
    """True iff ``pid`` is a live (non-zombie) QEMU serving ``cfg``'s agent socket."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    needle = f"path={cfg.agent_socket},".encode()
    return any(needle in arg for arg in argv)


class QemuVM:
    """A running QEMU. Create with ``launch`` or ``adopt``; end with ``stop``."""

    def __init__(self, cfg: VmConfig, pid: int, pidfd: int) -> None:
        self.config = cfg
        self.pid = pid
        self._pidfd = pidfd
        self._exited = asyncio.get_running_loop().create_future()
        self._qmp: QMPClient | None = None
        asyncio.get_running_loop().add_reader(pidfd, self._on_exit)

    @property
    def sandbox_id(self) -> str:
        return self.config.sandbox_id

    @classmethod
    async def launch(
        cls,
        cfg: VmConfig,
        *,
        qemu_binary: str = "qemu-system-x86_64",
        start_timeout_s: float = 10.0,
    ) -> QemuVM:
        """Start QEMU for ``cfg`` and connect QMP (the guest may still be booting).

        Raises Unavailable (with QEMU's own error output) if it exits or does not open
        its QMP socket within ``start_timeout_s``; nothing is left running then.
        """
        cfg.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for stale in (cfg.qmp_socket, cfg.agent_socket, cfg.pid_file):
            stale.unlink(missing_ok=True)
        cfg = replace(cfg, disk_format=await asyncio.to_thread(disk_format, cfg.rootfs))
        await asyncio.to_thread(_prepare_files, cfg)
        jail = jail_for(cfg.run_dir.parent)
        try:
            pid = await jail.spawn(
                cfg.run_dir.name,
                build_command(cfg, qemu_binary=qemu_binary),
                binds=jail_binds(cfg),
                owned=jail_owned(cfg),
                netns=cfg.netns,
                tap=cfg.tap,
                memory_mib=cfg.memory_mib,
                cpus=cfg.cpus,
                stderr_log=cfg.stderr_log,
                pid_file=cfg.pid_file,
                secrets=_secrets(cfg),
            )
        except Unavailable as exc:
            tail = _read_tail(cfg.stderr_log, 2048) or "(no log)"
            raise Unavailable(f"{exc}: {tail}", sandbox_id=cfg.sandbox_id) from exc
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            jail.release(cfg.run_dir.name)
            raise Unavailable(
                f"qemu exited at start: {_read_tail(cfg.stderr_log, 2048)}",
                sandbox_id=cfg.sandbox_id,
            ) from exc
        vm = cls(cfg, pid, pidfd)
        try:
            await vm._wait_for_qmp_socket(start_timeout_s)
            await vm._connect_qmp_when_listening(start_timeout_s)
        except Unavailable as exc:
            await vm.kill()
            raise Unavailable(
                f"{exc} ({_read_tail(cfg.stderr_log, 2048) or 'qemu said nothing'})",
                sandbox_id=cfg.sandbox_id,
            ) from exc
        except BaseException:
            await vm.kill()
            raise
        return vm

    @classmethod
    async def adopt(cls, cfg: VmConfig, pid: int) -> QemuVM:
        """Take over a QEMU started by an earlier node process; Unavailable if it is gone."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            raise Unavailable(f"qemu pid {pid} is gone", sandbox_id=cfg.sandbox_id) from exc
        # Checked after the pidfd exists, so a recycled pid cannot slip in between.
        if not pid_runs_vm(pid, cfg):
            os.close(pidfd)
            _reap(pid)  # a dead QEMU this very process spawned is a zombie until reaped
            raise Unavailable(f"pid {pid} is not this sandbox's qemu", sandbox_id=cfg.sandbox_id)
        vm = cls(cfg, pid, pidfd)
        try:
            await vm.connect_qmp()
        except Unavailable as exc:
            log.warning("sandbox %s: QMP reconnect failed (%s); signals only", pid, exc)
        return vm

    # lifecycle

    @property
    def alive(self) -> bool:
        return not self._exited.done()

    async def wait_exited(self) -> None:
        """Return once QEMU has exited (immediately if it has)."""
        await asyncio.shield(self._exited)

    async def connect_qmp(self) -> None:
        client = QMPClient(f"space-{self.sandbox_id}")
        try:
            async with asyncio.timeout(_QMP_TIMEOUT_S):
                await client.connect(str(self.config.qmp_socket))
        except Exception as exc:
            raise Unavailable(f"QMP connect failed: {exc}", sandbox_id=self.sandbox_id) from exc
        self._qmp = client

    async def _connect_qmp_when_listening(self, timeout_s: float) -> None:
        """Connect QMP, retrying while QEMU has bound its socket but not yet listens
        (a window that grows to seconds when many VMs start on a busy host)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                await self.connect_qmp()
                return
            except Unavailable as exc:
                refused = isinstance(exc.__cause__, ConnectionRefusedError) or isinstance(
                    getattr(exc.__cause__, "exc", None), ConnectionRefusedError
                )
                if not refused or not self.alive or asyncio.get_running_loop().time() > deadline:
                    raise
            await asyncio.sleep(0.05)

    async def query_status(self) -> str:
        """QEMU's run state (``running``, ``paused``, ``postmigrate``, ...).

        Unavailable without QMP."""
        if self._qmp is None:
            raise Unavailable("no QMP connection", sandbox_id=self.sandbox_id)
        reply = await self._execute("query-status")
        return str(reply["status"]) if isinstance(reply, dict) else "unknown"

    async def pause(self) -> None:
        """Stop the vCPUs (QMP ``stop``); memory and devices stay. Idempotent.

        Returns once QEMU confirmed. Raises Unavailable if QMP fails (reconnected once
        if it was lost) or QEMU has exited.
        """
        await self._execute("stop", reconnect=True)

    async def resume(self) -> None:
        """Restart the vCPUs (QMP ``cont``); idempotent. Raises as ``pause``."""
        await self._execute("cont", reconnect=True)

    async def save_state(self, path: Path, *, timeout_s: float = 60.0) -> int:
        """Write the paused VM's state to ``path``, fsynced; returns its size in bytes.

        The state is the devices' and, unless ``memory_shared`` (the RAM is in its file
        already), the RAM's: every page, a zero page as a flag only. With ``keys`` it is
        sealed (space.node.vmm.sealed_state) as QEMU writes it: no plaintext reaches the
        disk. The VM must be paused (``pause``); afterwards it stays paused until
        ``resume``. Uses migration to a file descriptor passed over QMP, unthrottled.
        Raises Unavailable (migration or the file's write failed, QMP lost) or Timeout.
        Cancellation cancels the migration; ``path`` is then incomplete (a sealed one
        never authenticates).
        """
        await self._set_migration_options()
        async with state_writer(path, self._state_key, sandbox_id=self.sandbox_id) as writer:
            await self._pass_fd(writer.qemu_fd, "state")
            writer.handed_over()
            await self._execute("migrate", {"uri": "fd:state"})
            try:
                await self._await_migration(timeout_s)
            except BaseException as exc:
                with contextlib.suppress(Unavailable):
                    await self._execute("migrate_cancel")
                if isinstance(exc, NodeError):
                    writer.check()  # a failed write is why QEMU failed
                raise
            return await writer.finish(timeout_s)

    async def load_state(self, path: Path, *, timeout_s: float = 60.0) -> None:
        """Load a state written by ``save_state`` into a VM launched ``incoming``.

        Returns once loaded; the VM is then paused (``resume`` runs it). A sealed state
        is opened with ``keys`` chunk by chunk, and QEMU reads only verified chunks; a
        plaintext state (saved before states were sealed) loads as it is. Raises
        Unavailable if the state does not authenticate or QEMU rejects it (QEMU exits
        then), or Timeout. A state without RAM needs ``memory_file`` to be the RAM it
        was saved with.
        """
        await self._set_migration_options()
        async with state_reader(path, self._state_key, sandbox_id=self.sandbox_id) as reader:
            await self._pass_fd(reader.qemu_fd, "state")
            reader.handed_over()
            await self._execute("migrate-incoming", {"uri": "fd:state"})
            try:
                await self._poll(timeout_s, self._incoming_done, "loading the VM state")
            except NodeError:
                reader.check()  # a chunk that did not authenticate is why QEMU failed
                raise
            await reader.finish(timeout_s)

    @property
    def _state_key(self) -> bytes | None:
        return self.config.keys.state_key if self.config.keys is not None else None

    async def _incoming_done(self) -> bool:
        return await self.query_status() != "inmigrate"

    async def _await_migration(self, timeout_s: float) -> None:
        async def done() -> bool:
            reply = await self._execute("query-migrate")
            status = reply.get("status") if isinstance(reply, dict) else None
            if status in ("failed", "cancelled"):
                error = reply.get("error-desc", status) if isinstance(reply, dict) else status
                raise Unavailable(
                    f"saving the VM state failed: {error}", sandbox_id=self.sandbox_id
                )
            return status == "completed"

        await self._poll(timeout_s, done, "saving the VM state")

    async def _poll(self, timeout_s: float, done: Callable[[], Awaitable[bool]], what: str) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not await done():
                    if not self.alive:
                        raise Unavailable(f"qemu exited while {what}", sandbox_id=self.sandbox_id)
                    await asyncio.sleep(0.002)
        except TimeoutError as exc:
            raise Timeout(f"{what} took over {timeout_s} s", sandbox_id=self.sandbox_id) from exc

    async def _set_migration_options(self) -> None:
        # x-ignore-shared leaves shared RAM out of a state and changes the stream's
        # format, so it is on for every save and load alike; RAM mapped private or
        # anonymous is written whole either way.
        caps = [{"capability": "x-ignore-shared", "state": True}]
        await self._execute("migrate-set-capabilities", {"capabilities": caps})
        # A paused VM's state is written as fast as the disk takes it (QEMU's default
        # throttle of 128 MiB/s would make a hibernate of 200 MiB take 1.6 s).
        await self._execute("migrate-set-parameters", {"max-bandwidth": _UNTHROTTLED})

    async def _pass_fd(self, fd: int, name: str) -> None:
        if self._qmp is None:
            raise Unavailable("no QMP connection", sandbox_id=self.sandbox_id)
        try:
            self._qmp.send_fd_scm(fd)
        except Exception as exc:
            raise Unavailable(f"passing a file to qemu: {exc}", sandbox_id=self.sandbox_id) from exc
        await self._execute("getfd", {"fdname": name})

    async def _execute(
        self,
        command: str,
        arguments: dict[str, object] | None = None,
        *,
        reconnect: bool = False,
    ) -> object:
        if not self.alive:
            raise Unavailable(f"qemu pid {self.pid} has exited", sandbox_id=self.sandbox_id)
        if self._qmp is None and reconnect:
            await self.connect_qmp()
        if self._qmp is None:
            raise Unavailable("no QMP connection", sandbox_id=self.sandbox_id)
        try:
            async with asyncio.timeout(_QMP_TIMEOUT_S):
                return await self._qmp.execute(command, arguments or None)
        except Exception as exc:
            raise Unavailable(f"QMP {command} failed: {exc}", sandbox_id=self.sandbox_id) from exc

    async def stop(self, *, grace_s: float = 3.0) -> None:
        """QMP quit, then SIGTERM, then SIGKILL, each with a deadline; idempotent."""
        if self.alive and self._qmp is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(grace_s):
                    await self._qmp.execute("quit")
        if await self._wait(grace_s):
            await self.detach()
            return
        await self._signal(signal.SIGTERM)
        if not await self._wait(grace_s):
            await self.kill()
        await self.detach()

    async def kill(self) -> None:
        """SIGKILL and wait for the exit; Unavailable if it survives 10 s."""
        await self._signal(signal.SIGKILL)
        if not await self._wait(10.0):
            raise Unavailable(f"qemu pid {self.pid} survived SIGKILL", sandbox_id=self.sandbox_id)
        await self.detach()

    async def detach(self) -> None:
        """Drop QMP and the exit watch; QEMU itself keeps running."""
        await self.disconnect_qmp()
        if self._pidfd >= 0:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    async def disconnect_qmp(self) -> None:
        """Drop the QMP connection (QEMU serves one client at a time); the exit watch
        and signals stay. Commands reconnect where they may (``reconnect``)."""
        if self._qmp is not None:
            qmp, self._qmp = self._qmp, None
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_QMP_TIMEOUT_S):
                    await qmp.disconnect()

    async def open_agent(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect to the guest agent's chardev socket."""
        try:
            return await asyncio.open_unix_connection(str(self.config.agent_socket))
        except OSError as exc:
            raise Unavailable(f"agent socket: {exc}", sandbox_id=self.sandbox_id) from exc

    def console_tail(self, max_bytes: int = 4096) -> str:
        return console_tail(self.config.console_log, max_bytes)

    # internals

    def _on_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        _reap(self.pid)
        jail_for(self.config.run_dir.parent).release(self.config.run_dir.name)
        if not self._exited.done():
            self._exited.set_result(None)

    async def _wait(self, timeout_s: float) -> bool:
        if not self.alive:
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.wait_exited()
        return not self.alive

    async def _signal(self, sig: signal.Signals) -> None:
        # Through the root broker: QEMU's uid is its jail's, not the node's.
        if self.alive and self._pidfd >= 0:
            with contextlib.suppress(NodeError):
                await jail_for(self.config.run_dir.parent).signal(
                    self._pidfd, self.config.run_dir, sig
                )

    async def _wait_for_qmp_socket(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.config.qmp_socket.exists():
            if not self.alive:
                raise Unavailable(
                    f"qemu exited at start: {_read_tail(self.config.stderr_log, 2048)}",
                    sandbox_id=self.sandbox_id,
                )
            if loop.time() > deadline:
                raise Unavailable("qemu did not open its QMP socket", sandbox_id=self.sandbox_id)
            await asyncio.sleep(0.005)


def _reap(pid: int) -> None:
    """Collect the exit status if ``pid`` is our own child (it is not after a restart)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _secrets(cfg: VmConfig) -> dict[str, bytes]:
    if cfg.disk_format == "raw":
        return {}
    if cfg.keys is None:
        raise Unavailable(
            f"{cfg.rootfs} is encrypted and the VM has no keys", sandbox_id=cfg.sandbox_id
        )
    return {_DISK_SECRET: cfg.keys.disk_passphrase}


def _prepare_files(cfg: VmConfig) -> None:
    """Make the files the jail binds exist (a RAM file mapped private is made readable
    by its jail's uid by the broker: it is the ready state's image all its sandboxes
    share, and another jail's uid may own it)."""
    for path in (cfg.console_log, cfg.memory_file):
        if path is not None and not path.exists():
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))


def console_tail(console_log: Path, max_bytes: int = 4096) -> str:
    """The last ``max_bytes`` of a console log (including its rotated part)."""
    data = _read_bytes_tail(console_log.with_suffix(".old"), max_bytes)
    data = (data + _read_bytes_tail(console_log, max_bytes))[-max_bytes:]
    return data.decode(errors="replace")


def trim_console(console_log: Path, max_bytes: int) -> None:
    """Keep a console log under ``max_bytes``: its tail moves to ``.old``, it restarts.

    QEMU appends (append=on), so after the truncation it writes at the new end. Output
    written between the read and the truncation can be lost; it is only a console.
    """
    try:
        if console_log.stat().st_size <= max_bytes:
            return
        tail = _read_bytes_tail(console_log, max_bytes // 2)
        console_log.with_suffix(".old").write_bytes(tail)
        os.truncate(console_log, 0)
    except OSError as exc:
        log.warning("cannot trim %s: %s", console_log, exc)


def _read_bytes_tail(path: Path, max_bytes: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read(max_bytes)
    except OSError:
        return b""


def _read_tail(path: Path, max_bytes: int) -> str:
    return _read_bytes_tail(path, max_bytes).decode(errors="replace").strip()
