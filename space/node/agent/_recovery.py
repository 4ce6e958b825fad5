"""What a starting node does with what the previous node process left behind.

Every persisted sandbox is re-adopted (its QEMU, or its runsc and channel relay, outlive
the node agent), finished or undone: an operation recorded as ``pending`` was
interrupted, and the VM's own run state says how far it got. Snapshot subvolumes
without a record were never published and go; so do volumes, console logs, QEMUs and
gVisor sandboxes no record claims. Every remaining volume gets its quota limit (again:
one made before the pool had quotas has none). Run by ``Node.start``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from space.node.agent._hidden import is_hidden
from space.node.agent._lifecycle import Lifecycle
from space.node.agent._registry import Registry
from space.node.api import NodeError, SandboxState, Unavailable
from space.node.core.capacity import volume_limit_mib
from space.node.core.sandbox import LiveSandbox, kill_strays
from space.node.core.state import SandboxRecord
from space.node.vmm.gvisor import GvisorGuest, gvisor_names, stop_by_name
from space.node.vmm.jail import jail_for

__all__ = ["recover"]

log = logging.getLogger(__name__)

#: Persisted states whose VM a restarted node takes over.
_ADOPTABLE = (SandboxState.CREATING, SandboxState.RUNNING, SandboxState.PAUSED)

Say = Callable[[str], None]


async def recover(node: Registry, say: Say) -> None:
    """Re-adopt, finish or clean up every sandbox and snapshot left on disk."""
    life = node.life
    records, bad = life.store.load_all()
    expected = {Path(r.run_dir).name: r.vmm_pid for r in records if not is_hidden(r.sandbox_id)}
    await kill_strays(life.config.effective_run_dir, expected, say)
    for name in sorted(await asyncio.to_thread(gvisor_names, node.run_root) - set(expected)):
        say(f"stopping stray gvisor sandbox {name}")
        await stop_by_name(node.run_root, name)
    await jail_for(life.config.effective_run_dir).sweep()
    for path in bad:
        say(f"removing unreadable state file {path.name}")
        await node.remove_leftovers(path.stem)
    await _unpublished_snapshots(life, records, say)
    for record in records:
        try:
            await _recover_one(node, record, say)
        except NodeError as exc:
            say(f"sandbox {record.sandbox_id}: recovery failed ({exc}); keeping it as error")
            sandbox = node.sandboxes.get(record.sandbox_id) or node.live(record)
            await sandbox.disconnect()
            sandbox.record = replace(sandbox.record, vmm_pid=None)
            life.store.save(sandbox.mark(SandboxState.ERROR, error=f"recovery failed: {exc}"))
            node.sandboxes[record.sandbox_id] = sandbox
    await _orphans(node, say)
    await _limit_volumes(node, say)


async def _unpublished_snapshots(life: Lifecycle, records: list[SandboxRecord], say: Say) -> None:
    """Delete snapshot subvolumes without a record, and records without a subvolume."""
    infos, bad = life.snapshots.load_all()
    for path in bad:
        say(f"removing unreadable snapshot record {path.name}")
        path.unlink()
    published = {info.snapshot_id for info in infos}
    for snapshot_id in set(life.pool.snapshot_ids()) - published:
        say(f"removing unpublished snapshot {snapshot_id}")
        await life.pool.delete_snapshot(snapshot_id)
    for info in infos:
        if not life.pool.snapshot_path(info.snapshot_id).is_dir():
            say(f"snapshot {info.snapshot_id} lost its subvolume; forgetting it")
            life.snapshots.remove(info.snapshot_id)


async def _recover_one(node: Registry, record: SandboxRecord, say: Say) -> None:
    sid = record.sandbox_id
    pending = record.pending
    sandbox = node.live(record)
    if is_hidden(record.sandbox_id):
        await node.destroy(sandbox)  # the node's own VM: a stray, killed already; remade as needed
    elif record.guest == "gvisor" and record.state == SandboxState.CREATING:
        # Its start command or ready check may not have run: it is not what was asked.
        say(f"sandbox {sid}: its creation was interrupted; removing it")
        await node.destroy(sandbox)
    elif pending is not None and pending.op == "fork":
        say(f"sandbox {sid}: its creation was interrupted; removing it")
        await node.destroy(sandbox)
    elif pending is not None and pending.op == "restore":
        await _redo_restore(node, sandbox, say)
    elif (
        pending is not None
        and pending.prior == SandboxState.HIBERNATED
        and pending.op
        in (
            "snapshot",
            "capture",
        )
    ):
        # A snapshot or fork of a hibernated sandbox never needed a VM.
        _finish_snapshot(node, sandbox)
        await _recover_hibernated(node, sandbox, say)
    elif record.state == SandboxState.HIBERNATED and pending is None:
        await _recover_hibernated(node, sandbox, say)
    elif record.vmm_pid is None or (record.state not in _ADOPTABLE and pending is None):
        say(f"sandbox {sid}: {record.state.value} without a VM; cleaning up")
        await node.destroy(sandbox)
    else:
        await _adopt(node, sandbox, record.vmm_pid, say)


async def _adopt(node: Registry, sandbox: LiveSandbox, pid: int, say: Say) -> None:
    try:
        await sandbox.reattach(node.run_root, pid)
    except NodeError as exc:
        say(f"sandbox {sandbox.sandbox_id}: cannot re-adopt ({exc}); cleaning up")
        await node.destroy(sandbox)
        return
    node.sandboxes[sandbox.sandbox_id] = sandbox
    sandbox.watch(node.life.on_vm_exit, node.life.config.console_max_bytes)
    await _settle_adopted(node, sandbox, say)


async def _settle_adopted(node: Registry, sandbox: LiveSandbox, say: Say) -> None:
    """Bring an adopted VM to a settled state, finishing its pending operation."""
    life, record = node.life, sandbox.record
    pending = record.pending
    if pending is not None and pending.op in ("hibernate", "snapshot", "capture"):
        _finish_snapshot(node, sandbox)
        say(f"sandbox {sandbox.sandbox_id}: undoing an interrupted {pending.op}")
        await life.thaw(sandbox, pending.prior)
        return
    if pending is None and isinstance(sandbox.vm, GvisorGuest):
        # runsc tells no run state: the record's is made true (both are idempotent).
        paused = record.state == SandboxState.PAUSED
        await (sandbox.pause() if paused else sandbox.resume())
    if await sandbox.vm_is_paused() and (pending is None or pending.op != "identity"):
        life.save(sandbox, SandboxState.PAUSED)
        say(
            f"sandbox {sandbox.sandbox_id}: re-adopted {record.guest} pid {record.vmm_pid} (paused)"
        )
        return
    if pending is not None and pending.op == "identity":
        with contextlib.suppress(NodeError):
            await sandbox.resume()
    await sandbox.connect(hello_timeout_s=life.config.boot_timeout_s)
    await life.settle_identity(sandbox)
    life.save(sandbox, SandboxState.RUNNING)
    say(f"sandbox {sandbox.sandbox_id}: re-adopted {record.guest} pid {record.vmm_pid} (running)")


def _finish_snapshot(node: Registry, sandbox: LiveSandbox) -> None:
    """An interrupted snapshot whose record was written is published: it is the head."""
    pending = sandbox.record.pending
    if pending is None or pending.op != "snapshot" or pending.snapshot_id is None:
        return
    if node.life.snapshots.path(pending.snapshot_id).exists():
        sandbox.record = replace(sandbox.record, head_snapshot=pending.snapshot_id)


async def _recover_hibernated(node: Registry, sandbox: LiveSandbox, say: Say) -> None:
    if not sandbox.state_file.is_file():
        raise _missing(sandbox)
    node.life.save(sandbox, SandboxState.HIBERNATED)
    node.sandboxes[sandbox.sandbox_id] = sandbox
    say(f"sandbox {sandbox.sandbox_id}: hibernated")


def _missing(sandbox: LiveSandbox) -> NodeError:
    return Unavailable("its saved memory is incomplete", sandbox_id=sandbox.sandbox_id)


async def _redo_restore(node: Registry, sandbox: LiveSandbox, say: Say) -> None:
    """A restore was interrupted: its old VM is doomed anyway, so do it again."""
    life, pending = node.life, sandbox.record.pending
    assert pending is not None and pending.snapshot_id is not None
    if sandbox.record.vmm_pid is not None:
        with contextlib.suppress(NodeError):
            await sandbox.reattach(node.run_root, sandbox.record.vmm_pid)
    node.sandboxes[sandbox.sandbox_id] = sandbox
    snapshot = life.snapshots.get(pending.snapshot_id)
    if snapshot is None:
        await sandbox.teardown()
        raise _missing(sandbox)
    say(f"sandbox {sandbox.sandbox_id}: finishing its restore to {snapshot.snapshot_id}")
    await life.restore(sandbox, snapshot)


async def _limit_volumes(node: Registry, say: Say) -> None:
    """Give every sandbox's volume its quota limit again: volumes made before the pool
    had quotas have none (issue 17). Idempotent; a failure is said, not raised."""
    for sandbox in node.sandboxes.values():
        spec = sandbox.record.spec
        limit_mib = volume_limit_mib(spec.disk_mib, spec.memory_mib)
        try:
            if sandbox.volume.is_dir():
                await node.life.pool.limit(sandbox.volume, limit_mib << 20)
        except Unavailable as exc:
            say(f"sandbox {sandbox.sandbox_id}: its volume keeps no quota limit ({exc})")


async def _orphans(node: Registry, say: Say) -> None:
    life = node.life
    known = set(node.sandboxes)
    # A sandbox handed over from a pool VM keeps that VM's volume and run dir names.
    known |= {s.record.volume for s in node.sandboxes.values()}
    known |= {Path(s.record.run_dir).name for s in node.sandboxes.values()}
    orphans = set(life.pool.sandbox_volumes())
    orphans |= {p.name.split(".console.")[0] for p in life.store.directory.glob("*.console.*")}
    orphans |= {p.stem for p in life.store.directory.glob("*.json")}
    for sid in sorted(orphans - known):
        say(f"removing leftovers of sandbox {sid}")
        await node.remove_leftovers(sid)
