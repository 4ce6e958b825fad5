"""What the VMM jail adds to starting a VM (issue 18).

Per run, in turn: a jailed QEMU started as the node starts one (``QemuVM.launch``:
cgroup, uid, namespaces, bind mounts, seccomp, in a fresh launcher interpreter), and the
same QEMU command started directly as root (the way before the jail), each until a QMP
session is open, then killed. QEMU waits for a saved state (``-incoming defer``), so what is
timed is the start alone, not the guest's boot: this is what the jail adds to a cold
create and to a create from a ready state (both start a QEMU). A pool hit starts no
QEMU (the VM is running already) and a guest exec passes no jail code: the jail adds
nothing to either. ``--vms N`` keeps N other jailed QEMUs running meanwhile, to show
whether the cost grows as the node fills (the uid scan reads /proc).
Usage: `.venv/bin/python bench/bench_jail.py [--runs 20] [--vms 0]` as root.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qemu.qmp import QMPClient
from qemu.qmp.protocol import ConnectError

from bench._stats import summary
from space.node.images import build_template
from space.node.privileged import Scope, start_broker
from space.node.vmm.jail import jail_for
from space.node.vmm.qemu import QemuVM, VmConfig, build_command


def _config(work: Path, run_root: Path, name: str) -> VmConfig:
    image = build_template("base", progress=lambda line: None)
    directory = work / name
    directory.mkdir()
    for target, source in (("kernel", image.kernel), ("initrd", image.initrd)):
        shutil.copyfile(source, directory / target)
    subprocess.run(
        ["cp", "--reflink=auto", "--sparse=always", str(image.rootfs), str(directory / "disk")],
        check=True,
    )
    return VmConfig(
        sandbox_id=name,
        run_dir=run_root / name,
        kernel=directory / "kernel",
        initrd=directory / "initrd",
        rootfs=directory / "disk",
        kernel_cmdline=image.kernel_cmdline,
        console_log=directory / "console.log",
        incoming=True,
    )


async def _jailed(cfg: VmConfig) -> float:
    start = time.perf_counter()
    vm = await QemuVM.launch(cfg)
    took = time.perf_counter() - start
    await vm.kill()
    return took


async def _direct(cfg: VmConfig) -> float:
    """The same QEMU as root in the host's namespaces, until its QMP answers."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    cfg.qmp_socket.unlink(missing_ok=True)
    start = time.perf_counter()
    argv = build_command(cfg)
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while True:  # as QemuVM.launch waits: a QMP session, capabilities negotiated
            client = QMPClient("bench")
            try:
                await client.connect(str(cfg.qmp_socket))
                await client.disconnect()
                return time.perf_counter() - start
            except ConnectError:
                await asyncio.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()


async def main(runs: int, vms: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="space-bench-jail-"))
    run_root = Path(tempfile.mkdtemp(prefix="sbj-", dir="/run"))
    broker = await start_broker(Scope(run_root, (work, run_root)))
    others: list[QemuVM] = []
    try:
        for i in range(vms):
            others.append(await QemuVM.launch(_config(work, run_root, f"other{i}")))
        jailed_cfg = _config(work, run_root, "jailed")
        direct_cfg = replace(jailed_cfg, run_dir=run_root / "direct")
        times: dict[str, list[float]] = {"jailed": [], "direct": []}
        for _ in range(runs):
            times["jailed"].append(1000 * await _jailed(jailed_cfg))
            times["direct"].append(1000 * await _direct(direct_cfg))
        print(f"QEMU start until QMP answers, {runs} runs, {vms} other jailed VMs running:")
        for name, values in times.items():
            print(summary(name, values, "ms"))
        jailed, direct = (sorted(times[k])[runs // 2] for k in ("jailed", "direct"))
        print(f"the jail adds {jailed - direct:.1f} ms p50 ({jailed / direct:.2f}x)")
    finally:
        for vm in others:
            await vm.kill()
        jail_for(run_root).close()
        await broker.close()
        shutil.rmtree(run_root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench_jail.py must run as root")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--vms", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.vms))
