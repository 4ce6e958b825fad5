"""VMs the node runs for itself: template build VMs and the VMs ready states are taken
from. Never listed, never handed to a tenant, removed by recovery after a restart.

Private to space.node.agent.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from space.node.api import (
    ExecExited,
    ExecOutput,
    ExecRequest,
    SandboxSpec,
    SandboxState,
    Unavailable,
)
from space.node.channel import GuestChannel
from space.node.core.capacity import Claim, volume_limit_mib
from space.node.core.sandbox import MEMORY_FILE, LiveSandbox, with_console
from space.node.core.state import SandboxRecord
from space.node.core.template import BASE, Shape, Template
from space.node.storage.btrfs import TemplateVolume

if TYPE_CHECKING:
    from space.node.agent._registry import Registry

#: How long a warm-up waits for the user's spawner helper to be ready (a python
#: starting: 0.1-0.8 s under gVisor, seconds under TCG); past it the VM is used all the
#: same, and its helper comes up in it.
_SPAWNER_WAIT_S = 10.0

__all__ = [
    "HIDDEN_PREFIXES",
    "POOL_PREFIX",
    "boot_hidden",
    "channel_of",
    "hidden_of",
    "is_hidden",
    "pool_vm_id",
    "start_command",
    "wait_ready",
    "warm_up",
]

#: The ids of warm pools' sandboxes (space.node.agent._pool).
POOL_PREFIX = "pool-"
#: Ids of the node's own VMs: pool VMs (space.node.agent._pool), build VMs, ready-state VMs.
HIDDEN_PREFIXES = (POOL_PREFIX, "build-", "ready-")
#: How long a start command must keep running before its template counts as ready.
START_GRACE_S = 1.0
#: How often a ready check is tried in the guest, and how long one HTTP try may take.
_READY_INTERVAL_S = 0.5
_READY_HTTP_TIMEOUT_S = 5.0
#: Beyond a check's own timeout: the probe's python3 start under TCG and the exec.
_READY_SLACK_S = 60.0
# Runs in the guest with its python3 (the one spaced runs on), as the template's user:
# tries the check every interval until it passes (exit 0) or the deadline (exit 1,
# printing the last failure). Arguments: timeout_s, interval_s, http_timeout_s, then
# "http" PORT PATH or "command" COMMAND.
_READY_PROBE = """
import subprocess, sys, time, urllib.request
timeout_s, interval_s, http_timeout_s = map(float, sys.argv[1:4])
kind, args = sys.argv[4], sys.argv[5:]
deadline = time.monotonic() + timeout_s
last = "never tried"
while True:
    try:
        if kind == "http":
            url = "http://127.0.0.1:%s%s" % (args[0], args[1])
            with urllib.request.urlopen(url, timeout=http_timeout_s) as response:
                if 200 <= response.status < 300:
                    sys.exit(0)
                last = "HTTP %d" % response.status
        else:
            left = max(deadline - time.monotonic(), 0.1)
            done = subprocess.run(["/bin/sh", "-c", args[0]], capture_output=True, timeout=left)
            if done.returncode == 0:
                sys.exit(0)
            output = (done.stdout + done.stderr)[-500:].decode("utf-8", "replace").strip()
            last = "exit code %d: %s" % (done.returncode, output)
    except Exception as exc:
        last = repr(exc)[:500]
    if time.monotonic() + interval_s > deadline:
        print(last)
        sys.exit(1)
    time.sleep(interval_s)
"""


def pool_vm_id() -> str:
    return POOL_PREFIX + secrets.token_hex(8)


def hidden_of(node: Registry, template: Template, sandbox_id: str, guest: str) -> LiveSandbox:
    """A new node's own sandbox ``sandbox_id`` of ``template`` in its ready shape
    (a warm pool's, a gVisor ready state's), CREATING, not yet saved."""
    record = SandboxRecord(
        spec=replace(template.ready_spec, sandbox_id=sandbox_id),
        state=SandboxState.CREATING,
        created_at=time.time(),
        template_digest=template.digest,
        run_dir=str(node.life.config.effective_run_dir / sandbox_id),
        guest=guest,
    )
    return node.live(record)


def is_hidden(sandbox_id: str) -> bool:
    return sandbox_id.startswith(HIDDEN_PREFIXES)


async def boot_hidden(
    node: Registry,
    vm_id: str,
    volume: TemplateVolume,
    shape: Shape,
    *,
    grow: bool,
    ram_in_volume: bool = False,
) -> LiveSandbox:
    """Boot a VM of ``shape`` on a CoW clone of ``volume``; RUNNING once its guest
    daemon answered. ``grow`` grows the disk image to the shape (only for an image no
    guest wrote). ``ram_in_volume`` maps its RAM shared from a file in its volume, to be
    captured as an image. Admitted like a sandbox of ``shape`` (InsufficientCapacity if
    the node has no room) and counted as the node's own running VM until ``destroy``.
    On failure nothing of it remains; a VM that died or fell silent at boot raises
    Unavailable or Timeout with its console's tail."""
    life = node.life
    spec = SandboxSpec(
        sandbox_id=vm_id,
        template=BASE,
        cpus=shape.cpus,
        memory_mib=shape.memory_mib,
        disk_mib=shape.disk_mib,
    )
    record = SandboxRecord(
        spec=spec,
        state=SandboxState.CREATING,
        created_at=time.time(),
        template_digest=volume.digest,
        run_dir=str(life.config.effective_run_dir / vm_id),
    )
    vm = node.live(record)
    with node.admission.claim({vm_id: Claim.node_vm(shape.memory_mib, shape.disk_mib)}):
        life.store.save(record)
        node.admission.hold(vm_id, shape.memory_mib)  # until destroy releases it
        try:
            await life.pool.create_sandbox_volume(
                record.volume,
                volume,
                disk_mib=shape.disk_mib,
                limit_mib=volume_limit_mib(shape.disk_mib, shape.memory_mib),
                grow=grow,
            )
            await vm.launch(
                qemu_binary=life.config.qemu_binary,
                memory_file=vm.volume / MEMORY_FILE if ram_in_volume else None,
                memory_shared=ram_in_volume,
            )
            life.save(vm, SandboxState.CREATING)
            await vm.connect(hello_timeout_s=life.config.boot_timeout_s)
            life.save(vm, SandboxState.RUNNING)
        except BaseException as exc:
            tail = vm.console_tail()
            await asyncio.shield(node.destroy(vm))
            error = with_console(exc, vm_id, tail)
            if error is exc:
                raise
            raise error from exc
    return vm


def channel_of(vm: LiveSandbox) -> GuestChannel:
    channel = vm.channel
    if channel is None or channel.closed:
        raise Unavailable("the VM's guest channel is closed", sandbox_id=vm.sandbox_id)
    return channel


async def start_command(channel: GuestChannel, template: Template, *, check: bool) -> None:
    """Start ``template``'s start command in the background, as ``user``, with its env
    and workdir. ``check`` waits START_GRACE_S and raises Unavailable (with its output)
    if it has exited by then."""
    if template.start is None:
        return
    request = ExecRequest(
        cmd=template.start,
        env=dict(template.env),
        cwd=template.workdir,
        background=True,
    )
    stream = await channel.exec(request)
    if not check:
        return
    await asyncio.sleep(START_GRACE_S)
    info = next(
        (p for p in await channel.list_processes() if p.process_id == stream.process_id), None
    )
    if info is None or info.running:
        return
    output = await _replay(channel, stream.process_id)
    raise Unavailable(
        f"the start command exited within {START_GRACE_S:g} s "
        f"(exit code {info.exit_code}, signal {info.signal}): {output}"
    )


async def _replay(channel: GuestChannel, process_id: str) -> str:
    """The last output a finished background process left, for an error message."""
    chunks: list[bytes] = []
    stream = await channel.attach(process_id)
    async for event in stream:
        if isinstance(event, ExecOutput):
            chunks.append(event.data)
    return b"".join(chunks)[-2000:].decode("utf-8", "replace").strip()


async def wait_ready(channel: GuestChannel, template: Template) -> None:
    """Poll ``template``'s ready check in the guest until it passes. Raises Unavailable
    (with the check's last failure) if it has not passed within its timeout."""
    check = template.ready_check
    if check is None:
        return
    if check.command is not None:
        target = ["command", check.command]
    else:
        target = ["http", str(check.http_port), str(check.http_path)]
    argv = ["python3", "-c", _READY_PROBE, str(check.timeout_s), str(_READY_INTERVAL_S)]
    request = ExecRequest(
        argv=[*argv, str(_READY_HTTP_TIMEOUT_S), *target],
        env=dict(template.env),
        cwd=template.workdir,
        timeout_s=check.timeout_s + _READY_SLACK_S,
    )
    chunks: list[bytes] = []
    exited: ExecExited | None = None
    async for event in await channel.exec(request):
        if isinstance(event, ExecOutput) and sum(map(len, chunks)) < 4096:
            chunks.append(event.data)
        elif isinstance(event, ExecExited):
            exited = event
    if exited is not None and exited.exit_code == 0:
        return
    output = b"".join(chunks)[-2000:].decode("utf-8", "replace").strip()
    raise Unavailable(f"the ready check {check.describe()} did not pass: {output}")


async def warm_up(channel: GuestChannel) -> None:
    """One ``true`` as the sandbox's user, before a pool VM waits or a ready state is
    taken: the paths an exec takes are then warm (translated, under TCG), and the
    spawner helper it started in spaced (docs/security.md) is ready, so a sandbox's
    first execs vfork instead of forking beside a python that starts."""
    stream = await channel.exec(ExecRequest(argv=["true"]))
    async for _ in stream:
        pass
    deadline = time.monotonic() + _SPAWNER_WAIT_S
    while time.monotonic() < deadline:
        if not (await channel.system_info())["spawner_starting"]:
            return
        await asyncio.sleep(0.02)
