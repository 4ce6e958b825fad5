"""Choose the accelerator QEMU runs guests with: KVM where it really works, else TCG.

``auto`` uses KVM only where a stock guest kernel really runs under it:

1. no /dev/kvm                                          -> tcg
2. the host is itself a PVM guest (module ``kvm_pvm``)   -> tcg (stock kernels hang there)
3. a probe boot of the guest kernel under ``-accel kvm`` reaches the initramfs within a
   hard deadline                                        -> kvm, else tcg

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
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from space.node.core.environment import child_environment

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
    kernel: Path,
    initrd: Path,
    kernel_digest: str,
    qemu_binary: str = "qemu-system-x86_64",
    probe_timeout_s: float = 10.0,
) -> Accelerator:
    """``choose_accelerator`` with this host's facts and a real probe boot."""

    async def probe() -> bool:
        return await probe_kvm_boot(qemu_binary, kernel, initrd, timeout_s=probe_timeout_s)

    return await choose_accelerator(
        mode,
        facts=host_facts(),
        probe=probe,
        cache_file=data_dir / "accel.json",
        kernel_digest=kernel_digest,
    )


async def probe_kvm_boot(qemu_binary: str, kernel: Path, initrd: Path, *, timeout_s: float) -> bool:
    """Boot ``kernel`` under KVM; True iff it reaches the initramfs within ``timeout_s``.

    The probe QEMU is always killed (its whole process group) before this returns.
    """
    argv = [
        qemu_binary, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-machine", "pc", "-accel", "kvm", "-cpu", "host", "-m", "256",
        "-kernel", str(kernel), "-initrd", str(initrd),
        "-append", "console=ttyS0 loglevel=7 panic=-1",
        "-serial", "stdio",
    ]  # fmt: skip
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            env=child_environment(),
        )
    except OSError as exc:
        log.warning("accelerator probe could not start %s: %s", qemu_binary, exc)
        return False
    try:
        async with asyncio.timeout(timeout_s):
            return await _wait_for_marker(proc.stdout)
    except TimeoutError:
        return False
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def _wait_for_marker(stream: asyncio.StreamReader | None) -> bool:
    if stream is None:
        return False
    tail = b""
    while chunk := await stream.read(4096):
        tail = (tail + chunk)[-_PROBE_TAIL_BYTES:]
        if any(marker in tail for marker in _INITRAMFS_MARKERS):
            return True
    return False


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
