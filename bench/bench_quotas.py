"""What btrfs quota groups cost the pool's volume operations (issue 17).

On two fresh 20 GiB loop pools, one with quotas off and one with them on (as the node
runs it), imports the base template, then per run, on each pool in turn: creates a
sandbox volume (snapshot of the template, qgroup limit on the quota pool, image grown
to 2 GiB), writes 64 MiB into its disk image as a guest would (scattered 1 MiB writes)
and commits them (the transaction commit is where qgroups account), takes a read-only
snapshot of it, and deletes both. Prints median and p90 of each step and of waiting for
btrfs's cleaner to drop every deleted subvolume (where qgroups cost most). The pools
are unmounted and their loop devices freed at the end, also on failure.
``--live N`` keeps N other sandbox volumes on each pool meanwhile, sharing the
template's extents as a node's sandboxes do.
Usage: `.venv/bin/python bench/bench_quotas.py [--runs 20] [--live 0]` as root.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._stats import summary
from space.node.core.capacity import volume_limit_mib
from space.node.core.run import run
from space.node.images import DEFAULT_CACHE_DIR
from space.node.privileged import Scope, start_broker
from space.node.storage.btrfs import BtrfsPool, TemplateVolume

DISK_MIB, MEMORY_MIB, WRITE_MIB = 2048, 256, 64
_NAMES = ("vmlinuz", "initrd.img", "rootfs.img")
Times = dict[str, list[float]]


async def _timed(step: Awaitable[object]) -> float:
    start = time.perf_counter()
    await step
    return (time.perf_counter() - start) * 1000


def _scribble(image: Path, mib: int, seed: int) -> None:
    """Write ``mib`` 1 MiB blocks at random places of the image and fsync them."""
    rng = random.Random(seed)
    blocks = image.stat().st_size >> 20
    block = os.urandom(1 << 20)
    fd = os.open(image, os.O_WRONLY)
    try:
        for _ in range(mib):
            os.pwrite(fd, block, rng.randrange(blocks) << 20)
        os.fsync(fd)
    finally:
        os.close(fd)


async def _drop_deleted(root: Path) -> None:
    """Commit (which wakes btrfs's cleaner) and wait until deleted subvolumes are gone."""
    await run("btrfs", "filesystem", "sync", str(root))
    # Polled here, every 10 ms: ``btrfs subvolume sync`` checks once a second.
    for _ in range(60_000):
        if not (await run("btrfs", "subvolume", "list", "-d", str(root))).strip():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("btrfs's cleaner did not drop the deleted subvolumes in 10 min")


async def _one_run(
    pool: BtrfsPool, template: TemplateVolume, i: int, times: Times, *, quotas: bool
) -> None:
    """Create, write, snapshot and delete one volume, timing each step into ``times``."""
    limit = volume_limit_mib(DISK_MIB, MEMORY_MIB) if quotas else None
    volume = f"sb-{i}"
    create = pool.create_sandbox_volume(volume, template, disk_mib=DISK_MIB, limit_mib=limit)
    times["create"].append(await _timed(create))
    scribble = asyncio.to_thread(_scribble, pool.sandbox_path(volume) / "rootfs.img", WRITE_MIB, i)
    times["write+commit"].append(await _timed(scribble))
    times["snapshot"].append(await _timed(pool.snapshot_volume(volume, f"snap-{i}")))
    start = time.perf_counter()
    await pool.delete_snapshot(f"snap-{i}")
    await pool.delete_sandbox_volume(volume)
    times["delete"].append((time.perf_counter() - start) * 1000)
    times["cleaner"].append(await _timed(_drop_deleted(pool.root)))


async def _measure(runs: int, live: int, image_dir: Path) -> dict[bool, Times]:
    """Both pools side by side, their runs interleaved, so that the load of a shared
    machine falls on both alike; ``live`` volumes sharing the template's extents on
    each, as on a node with that many sandboxes (qgroups account per sharing root)."""
    steps = ("create", "write+commit", "snapshot", "delete", "cleaner")
    times: dict[bool, Times] = {q: {step: [] for step in steps} for q in (False, True)}
    async with contextlib.AsyncExitStack() as stack:
        pools: dict[bool, tuple[BtrfsPool, TemplateVolume]] = {}
        for quotas in (False, True):
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-quotas-")))
            broker = await start_broker(Scope(tmp / "run", (tmp,)))
            stack.push_async_callback(broker.close)
            pool = await BtrfsPool.open(
                pool_path=None, data_dir=tmp, size_gib=20, broker=broker, quotas=quotas
            )
            stack.push_async_callback(pool.close, unmount=True)
            kernel, initrd, rootfs = (image_dir / n for n in _NAMES)
            template = await pool.import_template(
                "base", "bench", kernel=kernel, initrd=initrd, rootfs=rootfs
            )
            pools[quotas] = pool, template
            limit = volume_limit_mib(DISK_MIB, MEMORY_MIB) if quotas else None
            for i in range(live):
                await pool.create_sandbox_volume(
                    f"live-{i}", template, disk_mib=DISK_MIB, limit_mib=limit
                )
                rootfs = pool.sandbox_path(f"live-{i}") / "rootfs.img"
                await asyncio.to_thread(_scribble, rootfs, 4, -i)
        for i in range(runs):
            for quotas, (pool, template) in pools.items():
                await _one_run(pool, template, i, times[quotas], quotas=quotas)
    return times


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--live", type=int, default=0, help="other volumes on the pool")
    args = parser.parse_args()
    # The base image setup.sh built: the one directory with a manifest.
    image_dir = next(p.parent for p in sorted(DEFAULT_CACHE_DIR.glob("*/manifest.json")))
    for quotas, steps in (await _measure(args.runs, args.live, image_dir)).items():
        print(f"quotas {'on' if quotas else 'off'} ({args.runs} runs, {args.live} live):")
        for name, values in steps.items():
            print("  " + summary(name, values, "ms"))


if __name__ == "__main__":
    asyncio.run(main())
