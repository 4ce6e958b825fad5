"""Warm pools: per template, VMs already woken from its ready state, paused, waiting;
or, where the node's default guest type (``auto``) is gVisor, gVisor sandboxes of its
tree already started, their start command run and ready check passed, running: idle,
a gVisor sandbox costs no CPU (an idle VM under TCG burns one), and a hit then needs
no ``runsc resume`` (25-80 ms of a pool hit's 80-360 ms, measured on a loaded host).

A pool VM is a sandbox of the template's ready shape, named ``pool-<hex>``, that never
held tenant data: a clone of the ready state, woken with its own identity, warmed with
one ``true`` (under TCG the code paths a hit needs are then translated already), and
paused. A hit hands it over (the new sandbox's record takes over the VM, its volume
and run directory as they are, and the guest gets a fresh identity), so a create costs
a record, a ``cont`` and one guest call instead of a restore.

The pool refills in the background, one VM at a time. Its target follows demand: the
number of creates of the template in the last ``window_s`` seconds, clamped to
``min_size..max_size``. Pool VMs are not kept across node restarts (recovery removes
them and the pool fills again).

A gVisor pool serves creates of the template's shape as a VM pool does (its sandboxes'
links wait in their namespaces, egress closed, until the hand-over applies the
create's policy). Its hand-over is the same, but for ``runsc resume``: none is needed.
It refills by booting on the template's tree, not from the template's gVisor ready
state: a restore's burst of CPU beside a hit's first exec doubled that exec here
(21-25 -> 52 ms p50, bench/bench_gvisor.py), where a boot's did not.

A refill is admitted like a create of the template's shape (space.node.agent._admission):
on a node short of memory or pool space the pool stops refilling, and waits, rather than
push the node past its reserve. A waiting pool VM holds its memory (MemAvailable shows
it) but, paused, cannot grow (a gVisor one, idle, stays within its cgroup's limit), so
it is no part of the committed memory; a hit is a
create, admitted as one, and pool VMs are not sandboxes for the operator's cap.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from space.node.agent._gvisor_trees import boot_gvisor
from space.node.agent._hidden import channel_of, hidden_of, pool_vm_id, warm_up
from space.node.api import InsufficientCapacity, NodeError, PoolInfo, SandboxState
from space.node.core.capacity import Claim
from space.node.core.sandbox import LiveSandbox
from space.node.core.state import Pending
from space.node.core.template import Template
from space.node.core.validation import auto_guest
from space.node.vmm.qemu import QemuVM

if TYPE_CHECKING:
    from space.node.agent._registry import Registry

__all__ = ["Pools", "WarmPool", "hand_over", "make_pool_vm"]

log = logging.getLogger(__name__)

#: After a failed refill, wait this long before the next try (a broken template must not
#: spin the node).
_RETRY_S = 5.0
#: How long ``close`` waits for a pool VM being made before it cancels the making: a
#: make cancelled in the middle of its VMM's launch could leave that VMM running, known
#: to no node (a node restarted right after a hit, whose refill was booting).
_CLOSE_WAIT_S = 120.0


class WarmPool:
    """The warm pool of one template. ``start`` it; ``close`` deletes its VMs."""

    def __init__(
        self,
        template: str,
        *,
        make: Callable[[], Awaitable[LiveSandbox]],
        destroy: Callable[[LiveSandbox], Awaitable[Any]],
        min_size: int,
        max_size: int,
        guest: str = "qemu",
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= min_size <= max_size:
            raise ValueError(f"want 0 <= min_size <= max_size, got {min_size}, {max_size}")
        self.template = template
        #: The guest type of its sandboxes: a create of another type is no hit.
        self.guest = guest
        self.min_size, self.max_size, self.window_s = min_size, max_size, window_s
        self._make, self._destroy, self._clock = make, destroy, clock
        self._ready: collections.deque[LiveSandbox] = collections.deque()
        self._demand: collections.deque[float] = collections.deque()
        self._hits = self._misses = 0
        self._wanted = asyncio.Event()
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._discarding: set[asyncio.Future[None]] = set()

    @property
    def target(self) -> int:
        """How many paused VMs the pool fills towards now."""
        now = self._clock()
        while self._demand and self._demand[0] < now - self.window_s:
            self._demand.popleft()
        return max(self.min_size, min(self.max_size, len(self._demand)))

    def info(self) -> PoolInfo:
        return PoolInfo(
            template=self.template,
            size=len(self._ready),
            target=self.target,
            min_size=self.min_size,
            max_size=self.max_size,
            hits=self._hits,
            misses=self._misses,
        )

    def start(self) -> None:
        self._closing.clear()
        self._task = asyncio.get_running_loop().create_task(
            self._fill(), name=f"pool-{self.template}"
        )
        self._wanted.set()

    def take(self) -> LiveSandbox | None:
        """A waiting pool VM for a create, or None (a miss); counts demand either way.
        A miss wakes the refill at once; after a hit, call ``refill`` once the VM is
        handed over: a refill's boot would take the CPU the hand-over needs (on two
        cores, it doubled a gVisor hit's identity call)."""
        self._demand.append(self._clock())
        while self._ready:
            vm = self._ready.popleft()
            if vm.vm_alive and vm.record.state in (SandboxState.PAUSED, SandboxState.RUNNING):
                self._hits += 1
                return vm
            self._discard(vm)
        self._misses += 1
        self.refill()
        return None

    def refill(self) -> None:
        """Wake the refill (after a hit's hand-over, or a miss)."""
        self._wanted.set()

    async def close(self) -> None:
        """Stop refilling and delete every pool VM, one being made included (waited for,
        up to _CLOSE_WAIT_S, rather than cut short)."""
        if self._task is not None:
            self._closing.set()
            self._wanted.set()
            try:
                async with asyncio.timeout(_CLOSE_WAIT_S):
                    await asyncio.shield(self._task)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        while self._ready:
            await self._destroy(self._ready.popleft())

    async def _fill(self) -> None:
        while not self._closing.is_set():
            # Also wake once a window has passed: demand that stopped lowers the target.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.window_s):
                    await self._wanted.wait()
            self._wanted.clear()
            while len(self._ready) < self.target and not self._closing.is_set():
                try:
                    self._ready.append(await self._make())
                except InsufficientCapacity as exc:  # expected on a full node: no alarm
                    log.info("pool %s: not refilling: %s", self.template, exc)
                    await self._pause()
                except NodeError as exc:
                    log.warning("pool %s: making a VM failed: %s", self.template, exc)
                    await self._pause()
            while len(self._ready) > self.target and not self._closing.is_set():
                await self._destroy(self._ready.pop())

    async def _pause(self) -> None:
        """_RETRY_S before the next try, or less if the pool closes."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_RETRY_S):
                await self._closing.wait()

    def _discard(self, vm: LiveSandbox) -> None:
        """Drop a pool VM that died while waiting (its removal runs in the background)."""
        task = asyncio.ensure_future(self._destroy(vm))
        self._discarding.add(task)
        task.add_done_callback(self._discarding.discard)


class Pools:
    """The warm pools of the node's templates (one per template with a ready state)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        #: Warm pools by template digest (public: bench/bench_create.py takes the base
        #: template's out to time the other ways of creating, and puts it back).
        self.by_digest: dict[str, WarmPool] = {}

    def start(self, template: Template) -> None:
        """Start ``template``'s pool if pools are on and it has none yet: of the node's
        default guest type, which for QEMU needs the template's ready state."""
        registry = self._registry
        config = registry.config
        if config.warm_pool_max <= 0 or template.digest in self.by_digest:
            return
        guest = auto_guest(kvm=registry.accelerator == "kvm", without_kvm=config.guest_without_kvm)
        if not (
            (guest == "gvisor" and guest in registry.guest_types)
            or (guest == "qemu" and template.ready is not None)
        ):
            return
        warm = WarmPool(
            f"{template.name}:{template.tag}" if template.tag else template.name,
            make=functools.partial(make_pool_vm, registry, template, guest),
            destroy=self._registry.destroy,
            guest=guest,
            min_size=config.warm_pool_min,
            max_size=config.warm_pool_max,
        )
        self.by_digest[template.digest] = warm
        warm.start()

    async def create(self, sandbox: LiveSandbox, ready: Path) -> None:
        """Make ``sandbox`` from a ready state: a pool VM handed over if one waits, else
        a clone of the ready state woken. On failure the caller destroys ``sandbox``."""
        registry = self._registry
        if not await self._take(sandbox, "qemu"):
            async with registry.starts:
                await registry.life.create_from_image(sandbox, ready)

    async def take_gvisor(self, sandbox: LiveSandbox, template: Template) -> bool:
        """Make the gVisor ``sandbox`` a pool sandbox handed over, if one waits and it
        has the template's shape; whether it did. On failure the caller destroys
        ``sandbox``."""
        return template.shape.fits(sandbox.record.spec) and await self._take(sandbox, "gvisor")

    async def _take(self, sandbox: LiveSandbox, guest: str) -> bool:
        warm = self.by_digest.get(sandbox.record.template_digest)
        pooled = warm.take() if warm is not None and warm.guest == guest else None
        if pooled is None:
            return False
        assert warm is not None
        try:
            await hand_over(self._registry, pooled, sandbox)
        except BaseException:  # the caller destroys the sandbox, VM included
            with contextlib.suppress(NodeError):
                await self._registry.pool.delete_sandbox_volume(pooled.record.volume)
            self._registry.store.remove(pooled.sandbox_id)
            raise
        finally:
            warm.refill()
        return True

    async def drop(self, digest: str) -> None:
        """Close the pool of the template of ``digest`` (its VMs are deleted), if any."""
        warm = self.by_digest.pop(digest, None)
        if warm is not None:
            await warm.close()

    def infos(self) -> list[PoolInfo]:
        return [warm.info() for warm in self.by_digest.values()]

    async def close(self) -> None:
        """Close every pool (their VMs hold no tenant data: they are deleted)."""
        for warm in self.by_digest.values():
            await warm.close()
        self.by_digest.clear()


async def make_pool_vm(node: Registry, template: Template, guest: str = "qemu") -> LiveSandbox:
    """A warmed pool sandbox of ``template``, not listed among sandboxes: a VM woken
    from its ready state, paused; or (``guest`` gvisor) a gVisor sandbox of its tree
    and shape, started as a create starts one (its start command run,
    its ready check passed), running. Raises InsufficientCapacity (nothing made) if
    the node has no room for it."""
    sid = pool_vm_id()
    vm = hidden_of(node, template, sid, guest)
    spec = vm.record.spec
    with node.admission.claim({sid: Claim.node_vm(spec.memory_mib, spec.disk_mib)}):
        try:
            if guest == "gvisor":
                await boot_gvisor(node, vm, template)
                # spaced's first identity call in a gVisor sandbox takes ~20 ms, a later
                # one ~7: the first is paid here, not by the hit (a VM's wake from its
                # ready state had one).
                await node.life.apply_identity(vm, fresh=True)
                await warm_up(channel_of(vm))
            else:
                assert template.ready is not None
                await node.life.create_from_image(vm, template.ready)
                await warm_up(channel_of(vm))
                await vm.pause()
                node.life.save(vm, SandboxState.PAUSED)
        except BaseException:
            await asyncio.shield(node.destroy(vm))
            raise
    return vm


async def hand_over(node: Registry, pooled: LiveSandbox, sandbox: LiveSandbox) -> None:
    """Make the waiting pool VM ``pooled`` the new sandbox ``sandbox``; RUNNING after.

    The pool VM's record goes first (a crash then leaves a stray VM and volume,
    removed at the next start). Nothing QEMU has open moves: the sandbox's record names
    the VM's volume and run directory, which keep their names (QEMU reopens its disk by
    path when it saves state, so a renamed volume would break hibernate, snapshot and
    fork; issue 12). Only the console log, which QEMU holds open and never reopens,
    takes the sandbox's name. The record is written with a pending identity, then the
    VM runs and gets its fresh identity. On failure the caller destroys ``sandbox``,
    which owns the VM by then.
    """
    life = node.life
    channel, pooled.channel = pooled.channel, None  # kept open: unwatch would close it
    await pooled.unwatch()
    sandbox.vm, pooled.vm = pooled.vm, None
    sandbox.ruleset_open = pooled.ruleset_open  # the namespace goes with the VM
    life.store.remove(pooled.sandbox_id)
    await asyncio.to_thread(_rename, pooled.config.console_log, sandbox.config.console_log)
    sandbox.record = replace(
        sandbox.record, run_dir=pooled.record.run_dir, volume=pooled.record.volume
    )
    sandbox.config = replace(
        pooled.config, sandbox_id=sandbox.sandbox_id, console_log=sandbox.config.console_log
    )
    if isinstance(sandbox.vm, QemuVM):  # runsc keeps what it has: its bundle names the volume
        sandbox.vm.config = sandbox.config
    waited = pooled.record.state
    life.save(sandbox, SandboxState.RUNNING, pending=Pending("identity", waited, fresh=True))
    if waited == SandboxState.PAUSED:
        await sandbox.resume()
    sandbox.watch(life.on_vm_exit, life.config.console_max_bytes)
    if channel is None or channel.closed:
        await sandbox.connect(hello_timeout_s=life.config.boot_timeout_s)
    else:  # a HELLO less: the pool's session only ever ran its warm-up `true`
        sandbox.adopt(channel)
    await life.settle_identity(sandbox)


def _rename(source: Path, target: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.rename(source, target)
