"""Benchmark of sandbox creation paths side by side (issue 4).

The embedded platform in this process: one Node (as tests/integration starts it) on a
fresh data directory, and the control plane's REST API on a loopback port. Through the
SDK, the same template and shape (1 vCPU, 256 MiB, 2 GiB disk) is created again and
again, each create timed until the first exec (``true``) in it returned, then deleted
(not timed). The bench switches the node between paths in between:

(a) cold: a full copy of the template's files into a new subvolume + cold boot;
(b) a copy-on-write clone (btrfs snapshot) + cold boot;
(c) a copy-on-write clone of the template's ready state + restore of its memory;
(d) a warm-pool hit: a VM already woken from the ready state and paused, handed over.

Runs are interleaved (a, b, c, d, a, b, ...) so drift of the machine hits every path
alike; after each (d) the pool refills before the next create is timed, so no timed
create shares the machine with a refill. Prints median and p90 of each and its ratio
to (a). Everything is removed at the end, also on failure.
Usage: `.venv/bin/python bench/bench_create.py [--runs 30]` as root.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench._stats import summary
from space.control import ControlSettings, create_key
from space.control.server import run_control_plane
from space.node.agent import Node
from space.node.core.config import NodeConfig
from space.node.core.run import run as run_command
from space.node.storage.btrfs import BtrfsPool, TemplateVolume
from space.node.storage.disks import grow_disk
from space.sdk import AsyncSandbox
from tests.integration.conftest import release_data_dir
from tests.ports import free_port

PATHS = (
    "(a) full copy + cold boot",
    "(b) CoW clone + cold boot",
    "(c) CoW clone + ready state",
    "(d) warm pool hit",
)


async def full_copy_volume(
    pool: BtrfsPool, sandbox_id: str, template: TemplateVolume, *, disk_mib: int
) -> Path:
    """What creation costs without copy-on-write: every byte of the template copied."""
    path = pool.sandbox_path(sandbox_id)
    await run_command("btrfs", "subvolume", "create", str(path))
    for name in ("kernel", "initrd", "rootfs.img"):
        source = template.path / name
        await run_command("cp", "--reflink=never", str(source), str(path / name), timeout_s=300)
    await grow_disk(path / "rootfs.img", disk_mib)
    return path


async def _timed_create(api: tuple[str, str]) -> float:
    start = time.perf_counter()
    sandbox = await AsyncSandbox.create("base", memory_mib=256, api_url=api[0], api_key=api[1])
    try:
        result = await sandbox.commands.run(["true"])
        elapsed = (time.perf_counter() - start) * 1000
        if result.exit_code != 0:
            raise RuntimeError(f"true exited {result.exit_code}")
    finally:
        await sandbox.kill()
        await sandbox.close()
    return elapsed


def _path_setters(node: Node) -> list[Callable[[], None]]:
    """One function per path that switches the node to it."""
    catalog = node.templates.catalog
    base = catalog.resolve("base")
    ready_state = base.ready
    cow = node.pool.create_sandbox_volume
    warm = node.pools.by_digest.pop(base.digest)

    async def copying(
        volume: str,
        template: TemplateVolume,
        *,
        disk_mib: int,
        limit_mib: int | None,
        grow: bool = True,
    ) -> Path:
        del grow, limit_mib  # the base image is pristine: it is always grown; no quota
        return await full_copy_volume(node.pool, volume, template, disk_mib=disk_mib)

    def full_copy() -> None:
        catalog.set_ready(base.digest, None)
        node.pool.create_sandbox_volume = copying  # type: ignore[method-assign]

    def clone() -> None:
        catalog.set_ready(base.digest, None)
        node.pool.create_sandbox_volume = cow  # type: ignore[method-assign]

    def ready() -> None:
        catalog.set_ready(base.digest, ready_state)
        node.pool.create_sandbox_volume = cow  # type: ignore[method-assign]
        node.pools.by_digest.pop(base.digest, None)

    def pooled() -> None:
        ready()
        node.pools.by_digest[base.digest] = warm

    return [full_copy, clone, ready, pooled]


async def _pool_full(node: Node, timeout_s: float = 300.0) -> None:
    async with asyncio.timeout(timeout_s):
        while True:  # the pool has no event to wait on: it is polled, as a client would
            if any(p.size >= p.target > 0 for p in (await node.info()).pools):
                return
            await asyncio.sleep(0.1)


async def bench(node: Node, api: tuple[str, str], runs: int) -> dict[str, list[float]]:
    if node.templates.catalog.resolve("base").ready is None:
        raise RuntimeError("the node made no ready state for the base template")
    results: dict[str, list[float]] = {name: [] for name in PATHS}
    setters = _path_setters(node)
    for _ in range(runs):
        for name, use in zip(PATHS, setters, strict=True):
            use()
            if name == PATHS[3]:
                await _pool_full(node)
            results[name].append(await _timed_create(api))
        await _pool_full(node)
    setters[3]()
    return results


async def run(data_dir: Path, runs: int) -> dict[str, list[float]]:
    config = NodeConfig(
        data_dir=data_dir, pool_size_gib=8, boot_timeout_s=90.0, warm_pool_min=1, warm_pool_max=1
    )
    node = await Node.start(config)
    try:
        settings = ControlSettings(data_dir=data_dir / "control")
        port = free_port()
        # The key first: making it migrates the database, as the server's start does,
        # and two migrations at once in one process trip over alembic's global context.
        api = (f"http://127.0.0.1:{port}", await _key(settings))
        server = asyncio.ensure_future(
            run_control_plane(settings, node, host="127.0.0.1", port=port)
        )
        try:
            await _serving(api[0], server)
            return await bench(node, api, runs)
        finally:
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server
    finally:
        await node.shutdown(unmount_pool=True)


async def _key(settings: ControlSettings) -> str:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return await asyncio.to_thread(create_key, settings, "bench")


async def _serving(url: str, server: asyncio.Future[None], timeout_s: float = 60.0) -> None:
    async with httpx.AsyncClient() as client, asyncio.timeout(timeout_s):
        while not server.done():
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url}/openapi.json")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
        await server  # raises why it stopped


def report(results: dict[str, list[float]], say: Callable[[str], None] = print) -> None:
    baseline = statistics.median(results[PATHS[0]])
    for name, values in results.items():
        ratio = baseline / statistics.median(values)
        say(f"{summary(name, values, 'ms')}  {ratio:6.1f}x vs (a)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="space-bench-create-") as tmp:
        data_dir = Path(tmp) / "data"
        try:
            results = asyncio.run(run(data_dir, args.runs))
        finally:
            leaked = release_data_dir(data_dir)
            if leaked:
                print(f"cleaned up leftovers: {leaked}", file=sys.stderr)
    report(results)


if __name__ == "__main__":
    main()
