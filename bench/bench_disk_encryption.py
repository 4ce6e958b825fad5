"""What encrypting guest disks (LUKS, issue 18) costs a cold create and disk I/O.

Side by side, alternating run by run: the base image as a raw disk (the way before),
and as the node now keeps it, LUKS under a node key. Each run clones the image, makes
the disk ``--disk-mib`` (raw: truncate + the host's resize2fs; LUKS: truncate, and the
guest grows its ext4 as it boots), starts a jailed QEMU and waits for the guest's HELLO
(a cold create without the node around it). Then, in the same guest, a write and a read
of 128 MiB with O_DIRECT (``dd``; the guest's own page cache left out) give the disk's
throughput as the guest sees it. ``--vms N`` keeps N other VMs booted and idle
meanwhile, to show whether the cost grows as the node fills.
Usage: `.venv/bin/python bench/bench_disk_encryption.py [--runs 5] [--vms 0]` as root.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._stats import summary
from space.node.api import ExecExited, ExecOutput, ExecRequest
from space.node.channel import GuestChannel
from space.node.core.keys import NodeKeys
from space.node.core.run import run
from space.node.images import GuestImage, build_template
from space.node.privileged import Scope, start_broker
from space.node.storage.disks import DiskFormat, encrypt_image, grow_disk
from space.node.vmm.jail import jail_for
from space.node.vmm.qemu import QemuVM, VmConfig

KEYS = NodeKeys.from_node_key(os.urandom(32))
_DD = (
    "dd if=/dev/zero of=/home/user/f bs=1M count=128 oflag=direct 2>&1 | tail -1;"
    "dd if=/home/user/f of=/dev/null bs=1M iflag=direct 2>&1 | tail -1; rm /home/user/f"
)


async def _boot(
    image: GuestImage, disk: Path, work: Path, run_root: Path, name: str, disk_mib: int
) -> tuple[QemuVM, GuestChannel, float]:
    directory = work / name
    directory.mkdir()
    rootfs = directory / "rootfs.img"
    start = time.perf_counter()
    await run("cp", "--reflink=auto", "--sparse=always", str(disk), str(rootfs))
    await grow_disk(rootfs, disk_mib)
    cfg = VmConfig(
        sandbox_id=name,
        run_dir=run_root / name,
        kernel=image.kernel,
        initrd=image.initrd,
        rootfs=rootfs,
        kernel_cmdline=image.kernel_cmdline,
        console_log=directory / "console.log",
        keys=KEYS,
    )
    vm = await QemuVM.launch(cfg)
    reader, writer = await vm.open_agent()
    channel = await GuestChannel.open(reader, writer, sandbox_id=name, hello_timeout_s=120)
    return vm, channel, time.perf_counter() - start


async def _dd_mib_s(channel: GuestChannel) -> tuple[float, float]:
    """Write and read throughput of the guest's disk, in MiB/s (from dd's own lines)."""
    out = b""
    async for event in await channel.exec(ExecRequest(cmd=_DD)):
        if isinstance(event, ExecOutput):
            out += event.data
        elif isinstance(event, ExecExited) and event.exit_code != 0:
            raise RuntimeError(f"dd failed: {out!r}")
    rates = [_mib_s(m) for m in re.finditer(r"([\d.,]+) ([kMG]?B)/s", out.decode())]
    if len(rates) != 2:
        raise RuntimeError(f"unexpected dd output {out!r}")
    return rates[0], rates[1]


def _mib_s(match: re.Match[str]) -> float:
    value = float(match.group(1).replace(",", "."))
    return value * {"B": 1 / (1 << 20), "kB": 1000 / (1 << 20), "MB": 1e6 / (1 << 20)}.get(
        match.group(2), 1e9 / (1 << 20)
    )


async def _stop(vm: QemuVM, channel: GuestChannel) -> None:
    await channel.close()
    await vm.kill()


async def main(runs: int, vms: int, disk_mib: int) -> None:
    image = build_template("base", progress=lambda line: None)
    work = Path(tempfile.mkdtemp(prefix="space-bench-disk-"))
    run_root = Path(tempfile.mkdtemp(prefix="sbd-", dir="/run"))
    broker = await start_broker(Scope(run_root, (work, run_root)))
    running: list[tuple[QemuVM, GuestChannel]] = []
    try:
        luks = work / "base.luks"
        start = time.perf_counter()
        await encrypt_image(image.rootfs, luks, KEYS.disk_passphrase)
        print(f"encrypting the base image once, at import: {time.perf_counter() - start:.1f} s")
        disks: dict[DiskFormat, Path] = {"raw": image.rootfs, "luks": luks}
        for i in range(vms):
            vm, channel, _ = await _boot(image, luks, work, run_root, f"idle{i}", disk_mib)
            running.append((vm, channel))
        figures: dict[str, list[float]] = {}
        for run in range(runs):
            for form, disk in disks.items():
                vm, channel, took = await _boot(
                    image, disk, work, run_root, f"{form}{run}", disk_mib
                )
                try:
                    write, read = await _dd_mib_s(channel)
                finally:
                    await _stop(vm, channel)
                for what, value in (("create", took), ("write", write), ("read", read)):
                    figures.setdefault(f"{what} {form}", []).append(value)
        _report(figures, runs, vms, disk_mib)
    finally:
        for vm, channel in running:
            await _stop(vm, channel)
        jail_for(run_root).close()
        await broker.close()
        shutil.rmtree(run_root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def _report(figures: dict[str, list[float]], runs: int, vms: int, disk_mib: int) -> None:
    print(f"{runs} runs each, {disk_mib} MiB disk, {vms} other VMs running:")
    units = {"create": "s", "write": "MiB/s", "read": "MiB/s"}
    for name, values in figures.items():
        print(summary(name, values, units[name.split()[0]]))
    for what in units:
        raw, luks = (statistics.median(figures[f"{what} {f}"]) for f in ("raw", "luks"))
        print(f"{what}: LUKS / raw = {luks / raw:.2f}x (p50)")


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench_disk_encryption.py must run as root")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--vms", type=int, default=0)
    parser.add_argument("--disk-mib", type=int, default=4096)
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.vms, args.disk_mib))
