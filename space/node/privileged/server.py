"""The root broker: the one process of a node that keeps root (issue 18).

Started by the node (``RootBroker.start``) with its ``Scope``, it answers the typed
requests of ``space.node.privileged.requests`` on a unix socket only the node holds
(one end of a socket pair), each in a task of its own, and checks what each names
against the scope: files under the node's roots, namespaces of its own prefix, VMs by
run directory name. It ends when the node's end closes; the VMs and the gateway it
started run on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import logging
import os
import re
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

from space.node.api import InvalidArgument, NodeError
from space.node.network.fd_lines import FdLineReader, close_fds, write_line
from space.node.network.netns import guest_netns, node_prefix
from space.node.privileged import (
    _gateway,
    _gvisor,
    _gvisor_state,
    _gvisor_tree,
    _network,
    _storage,
    _streams,
)
from space.node.privileged._jails import Jails, signal_vm
from space.node.privileged.pinned import Pinned, pin, pin_parent, reopen
from space.node.privileged.requests import (
    MAX_LINE_BYTES,
    AdoptPool,
    AdoptReceived,
    BindListeners,
    CheckpointGvisor,
    CloneGuestTree,
    CreateNetns,
    DeleteNetns,
    DeleteSubvolume,
    EnableQuotas,
    ExclusiveBytes,
    LaunchGvisor,
    LaunchVm,
    LimitSubvolume,
    MakeGuestTree,
    MountPool,
    PauseGvisor,
    ReceiveSubvolume,
    ReferencedBytes,
    ReleaseVm,
    Request,
    RequestError,
    Scope,
    SendSubvolume,
    SetEgress,
    SignalVm,
    StartGateway,
    StopGateways,
    StopGvisor,
    SweepVms,
    UnmountPool,
    decode,
)
from space.node.vmm.gvisor import runsc_home

__all__ = ["Broker", "main"]

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_NETNS_TAIL_RE = re.compile(r"^[0-9a-f]{6}$")
_HOSTNAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
#: Bounds of one gVisor sandbox's resources (the node's own limits are far below).
_MAX_CPUS, _MAX_MEMORY_MIB = 256, 1 << 22
#: The devices a jail may be given besides those every jail has (the broker's own).
_DEVICES = ("/dev/kvm",)
#: Requests served at once; more wait to be read (the node serialises little itself).
_MAX_IN_FLIGHT = 64
Answer = tuple[object, list[socket.socket]]
#: The paths the request being handled holds open (see pinned.py), closed when it ends.
_held: contextvars.ContextVar[list[Pinned]] = contextvars.ContextVar("held")


class Broker:
    """What one node may ask of root, bounded by ``scope``."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        # Each root as the node names it and as it is (its real path has no link).
        self._roots = [(Path(os.path.abspath(r)), Path(os.path.realpath(r))) for r in scope.roots]
        self._netns_prefix = node_prefix(scope.run_root)
        self.jails = Jails(scope.run_root, scope.owner)
        self._handlers: dict[type[Request], Callable[..., Awaitable[object]]] = {
            MountPool: self._mount_pool,
            UnmountPool: self._unmount_pool,
            AdoptPool: lambda r: _storage.adopt_pool(
                self.path(r.root, below=True), self.scope.owner
            ),
            EnableQuotas: lambda r: _storage.enable_quotas(self.path(r.root)),
            LimitSubvolume: self._limit_subvolume,
            ReferencedBytes: lambda r: _storage.referenced_bytes(self.path(r.path, below=True)),
            ExclusiveBytes: lambda r: _storage.exclusive_bytes(self.path(r.path, below=True)),
            DeleteSubvolume: self._delete_subvolume,
            AdoptReceived: self._adopt_received,
            CreateNetns: lambda r: _network.create(self.netns(r.name), veth=r.veth),
            DeleteNetns: lambda r: _network.delete(self.netns(r.name)),
            SetEgress: lambda r: _network.set_open(self.netns(r.name), r.open),
            LaunchVm: self._launch_vm,
            ReleaseVm: self._release_vm,
            SweepVms: self._sweep_vms,
            StartGateway: self._start_gateway,
            StopGateways: self._stop_gateways,
            CloneGuestTree: lambda r: _gvisor.clone_tree(
                self.path(r.tree, below=True), self.path(r.volume, below=True, parent=True)
            ),
            PauseGvisor: lambda r: _gvisor.pause(
                self.vm_name(r.name), home=self._gvisor_home(), paused=r.paused
            ),
            StopGvisor: lambda r: _gvisor.remove(
                self.vm_name(r.name), home=self._gvisor_home(), cgroup=self._gvisor_cgroup(r.name)
            ),
        }

    async def handle(self, request: Request, fds: list[int]) -> Answer:
        """The value of ``request`` and the sockets to send with it. Raises NodeError."""
        held: list[Pinned] = []
        token = _held.set(held)
        try:
            if isinstance(request, BindListeners):
                return None, await _network.bind_listeners(self.netns(request.name))
            if isinstance(request, SendSubvolume | ReceiveSubvolume):
                if len(fds) != 1:
                    raise InvalidArgument(f"{request.op} takes one pipe")
                return await self._stream(request, fds[0]), []
            if isinstance(request, LaunchGvisor):
                if len(fds) != 1 + request.restore:
                    wanted = "a socket and a state" if request.restore else "one descriptor"
                    raise InvalidArgument(f"{request.op} takes {wanted}")
                return await self._launch_gvisor(request, *fds), []
            if isinstance(request, MakeGuestTree | CheckpointGvisor):
                if len(fds) != 1:
                    raise InvalidArgument(f"{request.op} takes one descriptor")
                if isinstance(request, CheckpointGvisor):
                    return await self._checkpoint_gvisor(request, fds[0]), []
                target = self.path(request.path, below=True, parent=True)
                await _gvisor_tree.make_tree(fds[0], target, self.scope.owner)
                return None, []
            if isinstance(request, SignalVm):
                if len(fds) != 1:
                    raise InvalidArgument("signal_vm takes one pidfd")
                run_dir = Path(self.path(request.run_dir, below=True).text)
                await asyncio.to_thread(signal_vm, fds[0], run_dir, request.signal)
                return None, []
            return await self._handlers[type(request)](request), []
        finally:
            _held.reset(token)
            for pinned in held:
                pinned.close()

    # what a request may name

    def path(
        self, text: str, *, below: bool = False, parent: bool = False, create: bool = False
    ) -> Pinned:
        """``text`` (relative: to the node's working directory, which is the broker's),
        a path under one of the roots (strictly, with ``below``) with no link in it,
        held open until the request ends (with ``parent``: its parent directory; with
        ``create``: missing directories made). Raises InvalidArgument; OSError if it is
        missing."""
        if ".." in Path(text).parts:
            raise InvalidArgument(f"{text!r} is not a normal path")
        path = Path(os.path.abspath(text))
        for named, real in self._roots:
            for root in (named, real):
                if path.is_relative_to(root) and not (below and path == root):
                    checked = str(real / path.relative_to(root))
                    pinned = pin_parent(checked) if parent else pin(checked, create=create)
                    _held.get().append(pinned)
                    return pinned
        raise InvalidArgument(f"{text} is outside this node's directories")

    def netns(self, name: str) -> str:
        """``name`` if it is one of this node's namespaces. Raises InvalidArgument."""
        tail = name.removeprefix(self._netns_prefix)
        if tail == name or not _NETNS_TAIL_RE.match(tail):
            raise InvalidArgument(f"{name!r} is not a namespace of this node")
        return name

    def vm_name(self, name: str) -> str:
        if not _NAME_RE.match(name):
            raise InvalidArgument(f"{name!r} is not a VM's name")
        return name

    # handlers

    async def _mount_pool(self, request: MountPool) -> None:
        image, mountpoint = self.path(request.image), self.path(request.mountpoint)
        await _storage.mount_pool(image, mountpoint, mkfs=request.mkfs)
        # Held again: what the path leads to now is the pool's root, not what it covers.
        await _storage.adopt_pool(self.path(request.mountpoint), self.scope.owner)

    async def _unmount_pool(self, request: UnmountPool) -> None:
        mountpoint = self.path(request.mountpoint, parent=True)
        await _storage.unmount_pool(self.path(request.image), mountpoint)

    async def _limit_subvolume(self, request: LimitSubvolume) -> None:
        if request.max_referenced <= 0:
            raise InvalidArgument("a quota limit is a positive number of bytes")
        await _storage.limit_subvolume(self.path(request.path, below=True), request.max_referenced)

    async def _delete_subvolume(self, request: DeleteSubvolume) -> None:
        try:
            target = self.path(request.path, below=True, parent=True)
        except FileNotFoundError:
            return  # gone with its parent: deleting is idempotent
        await _storage.delete_subvolume(target)

    #: The most a receive may take, whatever the agent asks (a sandbox's disk and
    #: memory are bounded far below).
    MAX_RECEIVE_BYTES = 1 << 40

    async def _stream(self, request: SendSubvolume | ReceiveSubvolume, pipe: int) -> object:
        """A send or receive of a subvolume through ``pipe`` (issue 19)."""
        if not stat.S_ISFIFO(os.fstat(pipe).st_mode):
            raise InvalidArgument(f"{request.op} takes a pipe")
        if isinstance(request, SendSubvolume):
            path = self.path(request.path, below=True)
            parent = None if request.parent is None else self.path(request.parent, below=True)
            await asyncio.to_thread(_streams.send_subvolume, path, parent, pipe)
            return None
        if not 0 < request.max_bytes <= self.MAX_RECEIVE_BYTES:
            raise InvalidArgument(f"a receive takes 1 to {self.MAX_RECEIVE_BYTES} bytes")
        pool, directory = self.path(request.pool), self.path(request.directory, below=True)
        received = await asyncio.to_thread(
            _streams.receive_subvolume, pool, directory, pipe, request.max_bytes
        )
        return {
            "name": received.name,
            "stream_bytes": received.stream_bytes,
            "sha256": received.sha256,
        }

    async def _adopt_received(self, request: AdoptReceived) -> None:
        target = self.path(request.path, below=True, parent=True)
        await asyncio.to_thread(
            _streams.adopt_received,
            target,
            self.scope.owner,
            writable=request.writable,
            guest_tree=request.guest_tree,
        )

    async def _launch_vm(self, request: LaunchVm) -> int:
        if request.memory_mib <= 0 or request.cpus <= 0 or not request.argv:
            raise InvalidArgument("a VM has an argv, memory and CPUs")
        binds, devices = [], []
        for path, mode in request.binds:
            if mode == "dev" and path in _DEVICES:
                devices.append(path)
            elif mode in ("ro", "rw"):
                binds.append((self.path(path), mode))
            else:
                raise InvalidArgument(f"a bind is ro, rw or one of the devices {_DEVICES}")
        return await self.jails.launch(
            self.vm_name(request.name),
            request.argv,
            binds=binds,
            devices=devices,
            owned=[self.path(p, below=True) for p in request.owned],
            netns=self.netns(request.netns) if request.netns is not None else None,
            tap=request.tap,
            memory_mib=request.memory_mib,
            cpus=request.cpus,
            stderr_log=self.path(request.stderr_log, below=True, parent=True),
            pid_file=self.path(request.pid_file, below=True, parent=True),
            secrets=request.secrets,
        )

    def _gvisor_home(self) -> Path:
        """runsc's state and bundles: root's, in the run root under a name no sandbox
        id can have."""
        home = runsc_home(self.scope.run_root)
        home.mkdir(mode=0o700, exist_ok=True)
        return home

    def _gvisor_cgroup(self, name: str) -> str:
        """A gVisor sandbox's cgroup (at the top of each hierarchy, as runsc makes it),
        named with the node's prefix."""
        return f"/{self._netns_prefix}gv-{self.vm_name(name)}"

    async def _checkpoint_gvisor(self, request: CheckpointGvisor, out_fd: int) -> int:
        home = self._gvisor_home()
        runsc = _gvisor.runsc_argv(home / "state")
        return await _gvisor_state.checkpoint(
            self.vm_name(request.name), runsc=runsc, home=home, out_fd=out_fd
        )

    async def _launch_gvisor(
        self, request: LaunchGvisor, channel_fd: int, state_fd: int | None = None
    ) -> int:
        if not stat.S_ISSOCK(os.fstat(channel_fd).st_mode):
            raise InvalidArgument("launch_gvisor takes a socket")
        if not (0 < request.cpus <= _MAX_CPUS and 0 < request.memory_mib <= _MAX_MEMORY_MIB):
            raise InvalidArgument("a gVisor sandbox has CPUs and memory within bounds")
        if not _HOSTNAME_RE.match(request.hostname):
            raise InvalidArgument(f"{request.hostname!r} is not a host name")
        name = self.vm_name(request.name)
        netns = None if request.netns is None else self.netns(request.netns)
        if request.networked:
            if netns is None:
                raise InvalidArgument("a network only inside a namespace of the node")
            await _network.address_guest(netns)
            netns = guest_netns(netns)  # the guest's link's, where runsc runs it
        # The guest's root in the volume, held with no link on the way: the volume's top
        # is the agent's, which could otherwise swap the name for a link to "/".
        volume = self.path(str(Path(request.volume) / _gvisor.TREE_ROOT), below=True)
        config = _gvisor.oci_config(
            rootfs=_gvisor.ROOTFS,
            hostname=request.hostname,
            netns=netns,
            cpus=request.cpus,
            memory_mib=request.memory_mib,
            cgroup=self._gvisor_cgroup(name),
        )
        log = self.path(request.log, below=True, parent=True)
        home = self._gvisor_home()
        image = None
        if state_fd is not None:
            # A checkpoint holds the guest's memory and gVisor's own state: bounded by
            # what the sandbox's cgroup lets it hold.
            limit = (request.memory_mib + 2 * _gvisor.OVERHEAD_MIB) << 20
            image = await _gvisor_state.stage_image(home, name, state_fd, limit)
        try:
            return await _gvisor.launch(
                name,
                home=home,
                config=config,
                rootfs=volume,
                channel_fd=channel_fd,
                log=log,
                owner=self.scope.owner,
                image=image,
                networked=request.networked,
            )
        finally:
            if image is not None:
                await _gvisor_state.release_image(image)

    async def _release_vm(self, request: ReleaseVm) -> None:
        await asyncio.to_thread(self.jails.cgroups.remove, self.vm_name(request.name))

    async def _sweep_vms(self, _request: SweepVms) -> None:
        await asyncio.to_thread(self.jails.cgroups.sweep)

    async def _start_gateway(self, request: StartGateway) -> None:
        for name in request.state:
            self.vm_name(name)  # a plain name in the directory
        # The CA first: a refused request makes no directory.
        upstream_ca = (
            None if request.upstream_ca is None else self._upstream_ca(request.upstream_ca)
        )
        try:
            await _gateway.start_gateway(
                self.path(request.directory, below=True, create=True),
                request.state,
                request.options,
                upstream_ca,
                request.environment,
                self.scope.owner,
            )
        finally:
            if upstream_ca is not None:
                os.close(upstream_ca)

    def _upstream_ca(self, text: str) -> int:
        """The upstream CA bundle ``text``, open, for root to copy to the gateway: a
        file anyone may read anyway, or one of the node's own."""
        fd = os.open(text, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_mode & 0o004:
            return fd  # checked as opened: a link swapped in later changes nothing
        os.close(fd)
        try:
            pinned = self.path(text)
        except InvalidArgument:
            raise InvalidArgument(f"the upstream CA {text} is not world-readable") from None
        return reopen(pinned, os.O_RDONLY | os.O_NONBLOCK)

    async def _stop_gateways(self, request: StopGateways) -> None:
        try:
            directory = self.path(request.directory, below=True)
        except FileNotFoundError:
            return  # never made: no gateway ran there
        await asyncio.to_thread(_gateway.stop_gateways, directory.path)


async def serve(broker: Broker, sock: socket.socket) -> None:
    """Answer requests on ``sock`` until its peer closes it."""
    reader = FdLineReader(sock, max_line_bytes=MAX_LINE_BYTES, max_fds=2)
    write_lock = asyncio.Lock()
    slots = asyncio.Semaphore(_MAX_IN_FLIGHT)
    async with asyncio.TaskGroup() as tasks:
        while True:
            try:
                line, fds = await reader.readline()
            except (OSError, ValueError) as exc:
                log.error("the node's connection failed: %s", exc)
                break
            if not line:
                break
            await slots.acquire()
            tasks.create_task(_answer(broker, sock, write_lock, slots, line, fds))


async def _answer(
    broker: Broker,
    sock: socket.socket,
    write_lock: asyncio.Lock,
    slots: asyncio.Semaphore,
    line: bytes,
    fds: list[int],
) -> None:
    request_id: int | None = None
    sockets: list[socket.socket] = []
    try:
        request_id, request = decode(line)
        value, sockets = await broker.handle(request, fds)
        answer: dict[str, object] = {"id": request_id, "ok": True, "value": value}
    except RequestError as exc:
        answer = {
            "id": request_id,
            "ok": False,
            "error": {"kind": "invalid_argument", "message": str(exc)},
        }
    except NodeError as exc:
        answer = {"id": request_id, "ok": False, "error": {"kind": exc.code, "message": str(exc)}}
    except Exception as exc:  # a failed command, a broken file: the node hears of it
        if not isinstance(exc, OSError):
            log.exception("request %s failed", request_id)
        answer = {
            "id": request_id,
            "ok": False,
            "error": {"kind": "unavailable", "message": str(exc)},
        }
    finally:
        close_fds(fds)
        slots.release()
    try:
        async with write_lock:
            await write_line(
                sock, json.dumps(answer).encode() + b"\n", [s.fileno() for s in sockets]
            )
    except OSError as exc:
        log.error("cannot answer the node: %s", exc)
    finally:
        for s in sockets:
            s.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m space.node.privileged")
    parser.add_argument("--fd", type=int, required=True, help="the node's end of the socket pair")
    parser.add_argument("--scope", required=True, help="the Scope, as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="root broker: %(levelname)s %(message)s")
    os.umask(0o077)
    broker = Broker(Scope.from_json(args.scope))
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(False)
    try:
        asyncio.run(serve(broker, sock))
    finally:
        with contextlib.suppress(Exception):
            broker.jails.close()
        _gvisor.release_home(runsc_home(broker.scope.run_root))
        with contextlib.suppress(OSError):  # only once empty: VMs left running keep theirs
            broker.scope.run_root.rmdir()  # its parent is root's: the agent cannot
        sock.close()
