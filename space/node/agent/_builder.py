"""Template builds: a spec's steps run in one build VM, each result kept as a layer.

Private to space.node.agent. A build resolves the spec's base, plans its steps (each keyed by
a digest of everything up to it, space.node.templates.steps) and skips every step whose
layer the pool already holds. From the first missing one it boots a build VM on a clone
of the last layer (or the base), and after each step syncs the guest, pauses the VM for
a moment and keeps its disk as the step's read-only layer. Packages are fetched by the
host (space.node.templates.packages) and installed by dpkg in the guest. Run steps run
as their user with a fixed environment, and reach the network only as the spec's
``build_egress`` allows (space.node.agent._build_network; none by default).

The last layer is published as the template's subvolume; the caller then makes its
ready state and only then moves the tag, so a failed build changes nothing a sandbox
can see.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from space.node.agent._build_cache import restore_layer, store_layer
from space.node.agent._build_network import BuildNetwork
from space.node.agent._catalog import Build, Catalog
from space.node.agent._hidden import boot_hidden, channel_of
from space.node.api import (
    ExecExited,
    ExecOutput,
    ExecRequest,
    ExecStream,
    InsufficientCapacity,
    NodeError,
    Unavailable,
)
from space.node.channel import GuestChannel
from space.node.core.sandbox import LiveSandbox
from space.node.core.template import READY_SHAPE, Shape, Template, image_mib
from space.node.images._rootfs import Debootstrap
from space.node.storage.btrfs import TemplateVolume
from space.node.templates import (
    CopyPlan,
    DebianBase,
    DigestBase,
    Packages,
    RunStep,
    Step,
    TemplateSpec,
    TemplateSpecError,
    describe,
    plan,
    template_digest,
)
from space.node.templates.packages import fetch_debs

if TYPE_CHECKING:
    from space.node.agent._registry import Registry

__all__ = ["BuildStepFailed", "Planned", "build_layers", "plan_build"]

Say = Callable[[str], None]

log = logging.getLogger(__name__)

#: The environment of run steps and package installs (not the spec's ``env``).
BUILD_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
}
#: The least memory a build VM gets, whatever the template's.
BUILD_MEMORY_MIB = 1024
#: Longest log line passed on; longer output lines are cut.
MAX_LINE = 4096
#: Output lines of a failing step quoted in its error.
_TAIL_LINES = 20
_STATUS_MAX = 64 << 20
_DEB_DIR = "/var/cache/space-build/debs"


class BuildStepFailed(NodeError):
    """A build step failed; ``step`` is its position in the plan (from 0)."""

    code = "build_failed"

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True, slots=True)
class Planned:
    """A spec resolved against the node: its base, shape and steps."""

    spec: TemplateSpec
    base: Template
    shape: Shape
    steps: list[Step]

    @property
    def digest(self) -> str:
        return template_digest(self.steps)

    def build_record(self, created_at: float) -> Build:
        config = self.spec.config
        return Build(
            digest=self.digest,
            base=str(self.spec.base),
            created_at=created_at,
            shape=self.shape,
            env=dict(config.env),
            workdir=config.workdir,
            start=config.start,
            ready_check=config.ready,
        )


async def plan_build(spec: TemplateSpec, spec_dir: Path, catalog: Catalog) -> Planned:
    """Resolve ``spec``'s base and resources and plan its steps (hashing copied files).

    Raises TemplateSpecError naming the key (``base``, ``resources.disk_mib``, a copy).
    """
    base = _resolve_base(spec, catalog)
    shape = _shape(spec, base)
    # The first digest holds the build's disk size (a layer holds a disk of that size)
    # and the template's name: layers are never shared between names, since the
    # control plane gives each tenant its own names, and a run step's output (a key
    # it generated, say) must not reach another tenant through the cache.
    seed = json.dumps(
        {"base": base.digest, "disk_mib": shape.disk_mib, "name": spec.name}, sort_keys=True
    )
    base_digest = hashlib.sha256(seed.encode()).hexdigest()
    steps = await asyncio.to_thread(plan, spec, spec_dir, base_digest)
    return Planned(spec, base, shape, steps)


def _resolve_base(spec: TemplateSpec, catalog: Catalog) -> Template:
    base = spec.base
    if isinstance(base, DebianBase):
        if base.release != Debootstrap.suite:
            raise TemplateSpecError(
                None, "base", f"this node has debian:{Debootstrap.suite} only, not {base}"
            )
        return catalog.base
    if isinstance(base, DigestBase):
        found = catalog.by_digest(base.digest)
    else:
        found = catalog.find(f"{base.name}:{base.tag}")
    if found is None:
        raise TemplateSpecError(None, "base", f"no template {base} on this node")
    return found


def _shape(spec: TemplateSpec, base: Template) -> Shape:
    wanted = spec.config.resources
    default = READY_SHAPE if base.pristine else base.shape
    disk = wanted.disk_mib if wanted.disk_mib is not None else default.disk_mib
    if base.pristine and disk < base.min_disk_mib:
        raise TemplateSpecError(None, "resources.disk_mib", f"at least {base.min_disk_mib}")
    if not base.pristine and disk != image_mib(base.volume):
        raise TemplateSpecError(
            None,
            "resources.disk_mib",
            f"a template built on {base.name} has its disk of {image_mib(base.volume)} MiB, "
            f"got {disk}",
        )
    return Shape(
        cpus=wanted.cpus or default.cpus,
        memory_mib=wanted.memory_mib or default.memory_mib,
        disk_mib=disk,
    )


async def build_layers(node: Registry, planned: Planned, say: Say) -> TemplateVolume:
    """Run every step without a layer yet; returns the last layer (or the base's volume).

    Raises BuildStepFailed (a step failed: its output is in the log and the message),
    or NodeError (the build VM failed). Layers of the steps that succeeded are kept.
    """
    pool = node.life.pool
    lines = describe(planned.steps)
    disk_steps = [s for s in planned.steps if s.kind != "config"]
    source: TemplateVolume = planned.base.volume
    # A layer holds every step up to its own (its digest chains them): start from the
    # last one there is, in the pool or the host's build cache.
    done = 0
    for position, step in enumerate(disk_steps, 1):
        if pool.layer(step.digest) is not None:
            done = position
    if disk_steps and done < len(disk_steps):
        last = disk_steps[-1]
        if await restore_layer(node, last.digest, planned.shape.disk_mib, say) is not None:
            done = len(disk_steps)
    for step in disk_steps[:done]:
        say(f"{lines[step.index]} (cached)")
    if done:
        source = pool.layer(disk_steps[done - 1].digest) or source
    todo = disk_steps[done:]
    if not todo:
        return source
    say(f"booting a build VM from {'the base' if source is planned.base.volume else 'the cache'}")
    # The build VM's memory is never kept, so it may be larger than the template's:
    # package installs and compilers need room. Its disk is the template's.
    shape = planned.shape
    build_shape = Shape(max(shape.cpus, 2), max(shape.memory_mib, BUILD_MEMORY_MIB), shape.disk_mib)
    grow = planned.base.pristine and source is planned.base.volume
    vm = await _boot_build_vm(node, source, build_shape, grow, say)
    try:
        async with node.build_network(vm, planned.spec.build_egress) as network:
            if network.ca_file is not None:
                say("run steps reach the network through the build's egress policy")
            for step in todo:
                say(lines[step.index])
                await _run_step(node, vm, step, say, network)
                source = await _keep_layer(node, vm, step)
    finally:
        await asyncio.shield(node.destroy(vm))
    await store_layer(node, source, say)
    return source


async def _boot_build_vm(
    node: Registry, source: TemplateVolume, shape: Shape, grow: bool, say: Say
) -> LiveSandbox:
    """Boot a build VM; one that dies before its guest answers is the node's loss, not
    the spec's fault, so another is booted once before the build fails."""
    try:
        return await boot_hidden(node, f"build-{secrets.token_hex(6)}", source, shape, grow=grow)
    except InsufficientCapacity:
        raise
    except Unavailable as exc:
        log.warning("a build VM died at boot; booting another: %s", exc.message)
        say("the build VM died at boot; booting another (the node's log has its console)")
    return await boot_hidden(node, f"build-{secrets.token_hex(6)}", source, shape, grow=grow)


async def _keep_layer(node: Registry, vm: LiveSandbox, step: Step) -> TemplateVolume:
    await _check(channel_of(vm), ExecRequest(argv=["sync"], user="root"), step, None)
    await vm.pause()
    try:
        return await node.life.pool.save_layer(vm.record.volume, step.digest)
    finally:
        await vm.resume()


async def _run_step(
    node: Registry, vm: LiveSandbox, step: Step, say: Say, network: BuildNetwork
) -> None:
    channel = channel_of(vm)
    action = step.action
    if isinstance(action, RunStep):
        request = ExecRequest(
            cmd=action.command,
            user=action.user,
            env=BUILD_ENV | network.env,
            cwd="/",
            timeout_s=node.life.config.build_step_timeout_s,
        )
        started = time.time()
        try:
            async with network.trusted(channel):
                await _check(channel, request, step, say)
        except BuildStepFailed as exc:
            refused = await network.refusals(started)
            for line in refused:
                say(f"egress refused {line}")
            hint = network.offline_hint(exc.message)
            if refused:
                hint = "the build's egress policy refused: " + "; ".join(refused)
            elif hint is not None:
                say(hint)
            else:
                raise
            raise BuildStepFailed(f"{exc.message}\n{hint}", step=exc.step) from exc
    elif isinstance(action, CopyPlan):
        await _copy(channel, action, step)
    elif isinstance(action, Packages):
        await _install(node, channel, action, step, say)


async def _check(channel: GuestChannel, request: ExecRequest, step: Step, say: Say | None) -> None:
    """Run ``request``; BuildStepFailed with the output's tail unless it exits 0."""
    tail: deque[str] = deque(maxlen=_TAIL_LINES)

    def line(text: str) -> None:
        tail.append(text)
        if say is not None:
            say(text)

    stream = await channel.exec(request)
    exited: ExecExited | None = None
    async for event in _lines(stream, line):
        exited = event
    if exited is not None and exited.exit_code == 0:
        return
    if exited is None or exited.timed_out:
        outcome = "timed out" if exited is not None else "ended without an exit status"
    elif exited.signal is not None:
        outcome = f"was killed by signal {exited.signal}"
    else:
        outcome = f"exited with code {exited.exit_code}"
    output = "\n".join(tail) or "(no output)"
    raise BuildStepFailed(
        f"step {step.index + 1} ({step.key}, {step.kind}) {outcome}; last output:\n{output}",
        step=step.index,
    )


async def _lines(stream: ExecStream, line: Say) -> AsyncIterator[ExecExited]:
    """Pass an exec stream's output on line by line; yields its ExecExited."""
    partial = {"stdout": b"", "stderr": b""}
    async for event in stream:
        if isinstance(event, ExecOutput):
            data = partial[event.stream] + event.data
            *complete, partial[event.stream] = data.split(b"\n")
            for raw in complete:
                line(_text(raw))
            if len(partial[event.stream]) > MAX_LINE:
                line(_text(partial[event.stream]))
                partial[event.stream] = b""
        elif isinstance(event, ExecExited):
            for rest in partial.values():
                if rest:
                    line(_text(rest))
            yield event


def _text(raw: bytes) -> str:
    return raw[:MAX_LINE].decode("utf-8", "replace").rstrip("\r")


async def _copy(channel: GuestChannel, action: CopyPlan, step: Step) -> None:
    dirs: dict[int, list[str]] = {}
    for entry in action.files:
        target = entry.target(action.dst)
        if entry.kind == "dir":
            await channel.make_dir(target, user="root")
            dirs.setdefault(entry.mode, []).append(target)
            continue
        await channel.write_file(
            target, _read_checked(entry.source, entry.sha256, step), user="root", mode=entry.mode
        )
    for mode, paths in dirs.items():
        await _check(
            channel, ExecRequest(argv=["chmod", f"{mode:o}", "--", *paths], user="root"), step, None
        )


async def _read_checked(path: Path, sha256: str | None, step: Step) -> AsyncIterator[bytes]:
    """``path``'s bytes in 1 MiB chunks; BuildStepFailed if they are not what was planned."""
    digest = hashlib.sha256()
    async for chunk in _read_all(path):
        digest.update(chunk)
        yield chunk
    if digest.hexdigest() != sha256:
        raise BuildStepFailed(f"{path} changed while the template was being built", step=step.index)


async def _install(
    node: Registry, channel: GuestChannel, action: Packages, step: Step, say: Say
) -> None:
    config = node.life.config
    status = await _read_guest_file(channel, "/var/lib/dpkg/status", _STATUS_MAX)
    work = config.data_dir / "apt"
    work.mkdir(exist_ok=True)
    debs = await fetch_debs(
        action.names, status=status, sources=config.apt_sources, work_dir=work, progress=say
    )
    if not debs:
        say("every package is installed already")
        return
    for deb in debs:
        await channel.write_file(f"{_DEB_DIR}/{deb.name}", _read_all(deb), user="root")
    paths = [f"{_DEB_DIR}/{deb.name}" for deb in debs]
    install = ExecRequest(
        # --force-unsafe-io: no fsync per unpacked file (unpacking the code interpreter's
        # 144 packages under TCG: 430 s with them, 326 s without, under other load);
        # the layer is taken after a `sync` anyway, and a build VM that dies fails.
        argv=[
            "dpkg",
            "--install",
            "--force-confdef",
            "--force-confold",
            "--force-unsafe-io",
            *paths,
        ],
        user="root",
        env=dict(BUILD_ENV),
        timeout_s=config.build_step_timeout_s,
    )
    await _check(channel, install, step, say)
    await _check(channel, ExecRequest(argv=["rm", "-rf", "--", _DEB_DIR], user="root"), step, None)


async def _read_guest_file(channel: GuestChannel, path: str, limit: int) -> bytes:
    reader = await channel.read_file(path, user="root")
    if reader.stat.size > limit:
        await reader.aclose()
        raise Unavailable(f"{path} in the build VM is {reader.stat.size} bytes, over {limit}")
    chunks, size = [], 0
    async for chunk in reader:
        size += len(chunk)
        if size > limit:
            raise Unavailable(f"{path} in the build VM grew past {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_all(path: Path) -> AsyncIterator[bytes]:
    with await asyncio.to_thread(open, path, "rb") as file:
        while chunk := await asyncio.to_thread(file.read, 1 << 20):
            yield chunk
