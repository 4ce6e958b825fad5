"""Choose the accelerator QEMU runs guests with: KVM where it really works, else TCG.

``auto`` uses KVM only where a stock guest kernel really runs under it:

1. no /dev/kvm                                          -> tcg
2. the host is itself a PVM guest (module ``kvm_pvm``)   -> tcg (stock kernels hang there)
3. a probe boot of the guest kernel under ``-accel kvm``, jailed as a VM is, reaches
   the initramfs within a hard deadline                 -> kvm, else tcg

The probe result is cached in ``data_dir/accel.json`` keyed by the guest kernel's digest
and the host kernel release, so it runs once per (kernel, host). Detection never hangs:
the probe QEMU is killed at its deadline. ``kvm`` and ``tcg`` force the choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from space.node.api import NodeError
from space.node.vmm.jail import Bind, Jail, jail_for

__all__ = [
    "Accelerator",
    "HostFacts",
    "choose_accelerator",
    "detect_accelerator",
    "host_facts",
    "probe_kvm_boot",
]

log = logging.getLogger(__name__)

Accelerator = Literal["kvm", "tcg"]
ProbeBoot = Callable[[], Awaitable[bool]]

#: Kernel messages printed once the kernel hands over to the initramfs.
_INITRAMFS_MARKERS = (b"Run /init as init process", b"Freeing unused kernel image")
_PROBE_TAIL_BYTES = 4096
_PROBE_NAME = "accel-probe"
_PROBE_POLL_S = 0.05
_PROBE_KILL_WAIT_S = 5.0
_DEV_KVM = Path("/dev/kvm")


@dataclass(frozen=True, slots=True)
class HostFacts:
    kvm_device: bool
    pvm_host: bool
    release: str


def host_facts(
    *,
    dev_kvm: Path = Path("/dev/kvm"),
    proc_modules: Path = Path("/proc/modules"),
    sys_module: Path = Path("/sys/module"),
) -> HostFacts:
    """Read what decides the accelerator from the host (paths injectable for tests)."""
    try:
        modules = proc_modules.read_text()
    except OSError:
        modules = ""
    pvm = any(line.split(" ", 1)[0] == "kvm_pvm" for line in modules.splitlines())
    pvm = pvm or (sys_module / "kvm_pvm").exists()
    return HostFacts(kvm_device=dev_kvm.exists(), pvm_host=pvm, release=os.uname().release)


async def choose_accelerator(
    mode: Literal["auto", "kvm", "tcg"],
    *,
    facts: HostFacts,
    probe: ProbeBoot,
    cache_file: Path | None = None,
    kernel_digest: str = "",
) -> Accelerator:
    """Decide per the module docstring; the probe runs only when steps 1-2 allow KVM."""
    if mode != "auto":
        return mode
    if not facts.kvm_device:
        log.info("accelerator: tcg (no /dev/kvm)")
        return "tcg"
    if facts.pvm_host:
        log.info("accelerator: tcg (host is a PVM guest; stock kernels hang under its KVM)")
        return "tcg"
    key = f"{kernel_digest}:{facts.release}"
    cached = _read_cache(cache_file, key)
    if cached is not None:
        return cached
    result: Accelerator = "kvm" if await probe() else "tcg"
    log.info(
        "accelerator: %s (probe boot under KVM %s)",
        result,
        "passed" if result == "kvm" else "failed",
    )
    _write_cache(cache_file, key, result)
    return result


async def detect_accelerator(
    mode: Literal["auto", "kvm", "tcg"],
    *,
    data_dir: Path,
    run_root: Path,
    kernel: Path,
    initrd: Path,
    kernel_digest: str,
    qemu_binary: str = "qemu-system-x86_64",
    probe_timeout_s: float = 10.0,
) -> Accelerator:
    """``choose_accelerator`` with this host's facts and a real probe boot."""

    async def probe() -> bool:
        return await probe_kvm_boot(
            qemu_binary, kernel, initrd, run_root=run_root, timeout_s=probe_timeout_s
        )

    return await choose_accelerator(
        mode,
        facts=host_facts(),
        probe=probe,
        cache_file=data_dir / "accel.json",
        kernel_digest=kernel_digest,
    )


async def probe_kvm_boot(
    qemu_binary: str, kernel: Path, initrd: Path, *, run_root: Path, timeout_s: float
) -> bool:
    """Boot ``kernel`` under KVM; True iff it reaches the initramfs within ``timeout_s``.

    The probe runs jailed as every VM does (``run_root``'s jail), so it finds out what
    a VM will get: the node agent itself may not open /dev/kvm, a jail has a node of
    its own. The probe QEMU is always killed and its jail released before this returns.
    """
    argv = [
        qemu_binary, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-machine", "pc", "-accel", "kvm", "-cpu", "host", "-m", "256",
        "-kernel", str(kernel), "-initrd", str(initrd),
        "-append", "console=ttyS0 loglevel=7 panic=-1",
        "-serial", "stdio",
    ]  # fmt: skip
    run_dir = run_root / _PROBE_NAME
    # Its run directory in its argv: what the broker checks before it signals a VMM.
    argv += ["-D", str(run_dir / "debug.log")]
    output = run_dir / "qemu.log"  # the jail's stdout: the guest's serial console
    await asyncio.to_thread(shutil.rmtree, run_dir, True)
    run_dir.mkdir(mode=0o700, parents=True)
    binds = [Bind(kernel, "ro"), Bind(initrd, "ro"), Bind(run_dir, "rw")]
    if await asyncio.to_thread(_DEV_KVM.exists):
        binds.append(Bind(_DEV_KVM, "dev"))
    jail = jail_for(run_root)
    try:
        try:
            pid = await jail.spawn(
                _PROBE_NAME,
                argv,
                binds=binds,
                owned=[run_dir],
                netns=None,
                tap="",
                memory_mib=256,
                cpus=1,
                stderr_log=output,
                pid_file=run_dir / "qemu.pid",
            )
            pidfd = os.pidfd_open(pid)
        except (NodeError, OSError) as exc:
            log.warning("accelerator probe could not start %s: %s", qemu_binary, exc)
            return False
        try:
            return await _wait_for_marker(output, pidfd, timeout_s)
        finally:
            await _kill(jail, pidfd, pid, run_dir)
    finally:
        await asyncio.to_thread(shutil.rmtree, run_dir, True)


async def _wait_for_marker(output: Path, pidfd: int, timeout_s: float) -> bool:
    """True once ``output`` shows a marker; False at the deadline or when the process
    of ``pidfd`` has exited without one."""
    deadline = time.monotonic() + timeout_s
    while True:
        exited = select.select([pidfd], [], [], 0)[0]
        tail = await asyncio.to_thread(_tail, output)
        if any(marker in tail for marker in _INITRAMFS_MARKERS):
            return True
        if exited or time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_PROBE_POLL_S)


async def _kill(jail: Jail, pidfd: int, pid: int, run_dir: Path) -> None:
    try:
        with contextlib.suppress(NodeError):
            await jail.signal(pidfd, run_dir, signal.SIGKILL)
        await asyncio.to_thread(_reap, pidfd, pid)
    finally:
        os.close(pidfd)
        jail.release(_PROBE_NAME)


def _tail(output: Path) -> bytes:
    try:
        with open(output, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - _PROBE_TAIL_BYTES))
            return f.read(_PROBE_TAIL_BYTES)
    except OSError:
        return b""


def _reap(pidfd: int, pid: int) -> None:
    """Wait for the process to end, and reap it: the node is its jailed VMMs' reaper
    (``jail_for``)."""
    select.select([pidfd], [], [], _PROBE_KILL_WAIT_S)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _read_cache(cache_file: Path | None, key: str) -> Accelerator | None:
    if cache_file is None:
        return None
    try:
        value = json.loads(cache_file.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value if value in ("kvm", "tcg") else None


def _write_cache(cache_file: Path | None, key: str, value: Accelerator) -> None:
    if cache_file is None:
        return
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({key: value}))
        os.replace(tmp, cache_file)
    except OSError as exc:
        log.warning("cannot cache the accelerator choice in %s: %s", cache_file, exc)
