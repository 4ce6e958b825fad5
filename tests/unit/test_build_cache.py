"""The build cache (space/node/agent/_build_cache.py): every input that goes into a
cached layer changes its key; a layer kept on a real btrfs pool is received back, and a
damaged entry is refused and dropped. The VM side is tests/integration/
test_template_ready.py (and test_e2b_code_interpreter.py at scale)."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from space.node.agent._build_cache import _prune, cache_key, restore_layer, store_layer
from space.node.agent._registry import Registry
from space.node.storage.btrfs import BtrfsPool, TemplateVolume

from .test_btrfs_pool import _open, data_dir, image_files, runner  # noqa: F401

LAYER = "ab" * 32
KEY_ID = "k1"
SOURCES = ("deb [trusted=yes] copy:/var/cache/space/debs/code-interpreter-1 ./",)


def test_the_same_inputs_give_the_same_key_whatever_the_order_of_the_sources() -> None:
    two = (*SOURCES, "deb http://deb.debian.org/debian bookworm main")
    assert cache_key(LAYER, KEY_ID, two) == cache_key(LAYER, KEY_ID, tuple(reversed(two)))
    assert len(cache_key(LAYER, KEY_ID, SOURCES)) == 64


def test_the_layer_the_node_key_and_every_apt_source_change_the_key() -> None:
    keys = {
        cache_key(LAYER, KEY_ID, SOURCES),
        cache_key("cd" * 32, KEY_ID, SOURCES),
        cache_key(LAYER, "k2", SOURCES),
        cache_key(LAYER, KEY_ID, ("deb [trusted=yes] copy:/var/cache/space/debs/other ./",)),
        cache_key(LAYER, KEY_ID, (*SOURCES, "deb http://deb.debian.org/debian bookworm main")),
        cache_key(LAYER, KEY_ID, ()),
    }
    assert len(keys) == 6


@pytest.fixture
def pool(data_dir: Path, runner: asyncio.Runner) -> Iterator[BtrfsPool]:  # noqa: F811
    pool = runner.run(_open(data_dir))
    try:
        yield pool
    finally:
        runner.run(pool.close(unmount=True))


def _layer(pool: BtrfsPool, loop: asyncio.Runner, files: dict[str, Any]) -> TemplateVolume:
    """A layer of the pool, made as a build makes one: a volume of a template, kept."""
    base = loop.run(pool.import_template("base", "d1", **files))
    loop.run(pool.create_sandbox_volume("build-1", base, disk_mib=64, limit_mib=None))
    (pool.sandbox_path("build-1") / "rootfs.img").write_bytes(b"built " * 1000)
    layer = loop.run(pool.save_layer("build-1", LAYER))
    loop.run(pool.delete_sandbox_volume("build-1"))
    return layer


def _forget(layer: TemplateVolume) -> None:
    """Delete a layer from the pool, as on a fresh pool."""
    subprocess.run(
        ["btrfs", "property", "set", "-f", "-ts", str(layer.path), "ro", "false"], check=True
    )
    subprocess.run(
        ["btrfs", "subvolume", "delete", str(layer.path)], check=True, capture_output=True
    )


def test_a_kept_layer_comes_back_and_a_damaged_one_is_refused_dropped_and_replaced(
    pool: BtrfsPool,
    runner: asyncio.Runner,  # noqa: F811
    image_files: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    config = SimpleNamespace(build_cache_dir=cache, apt_sources=SOURCES, build_cache_gib=20)
    node = cast(
        Registry, SimpleNamespace(config=config, keys=SimpleNamespace(key_id=KEY_ID), pool=pool)
    )
    said: list[str] = []
    layer = _layer(pool, runner, image_files)
    runner.run(store_layer(node, layer, said.append))
    key = cache_key(LAYER, KEY_ID, SOURCES)
    record, stream = cache / f"{key}.json", cache / f"{key}.stream"
    assert record.is_file() and stream.is_file(), said
    assert sorted(p.name for p in cache.iterdir()) == [record.name, stream.name]
    # A tenant's template: the node's user alone reads it.
    assert {stat.S_IMODE(p.stat().st_mode) for p in (record, stream)} == {0o600}

    _forget(layer)
    assert pool.layer(LAYER) is None
    os.utime(record, (1000, 1000))
    back = runner.run(restore_layer(node, LAYER, 64, said.append))
    assert back is not None and back.rootfs.read_bytes() == b"built " * 1000
    assert any(line.startswith("receiving layer") for line in said), said
    assert record.stat().st_mtime > time.time() - 60  # a hit is a use: the bound keeps it

    _forget(back)
    data = bytearray(stream.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stream.write_bytes(bytes(data))
    said.clear()
    assert runner.run(restore_layer(node, LAYER, 64, said.append)) is None
    assert any("is refused" in line for line in said), said
    assert pool.layer(LAYER) is None
    assert list((pool.root / "incoming").iterdir()) == []  # nothing half-received
    assert list(cache.iterdir()) == []  # dropped: later builds would refuse it again
    # The build that ran the steps keeps its layer in the entry's place.
    layer = _layer(pool, runner, image_files)
    runner.run(store_layer(node, layer, said.append))
    _forget(layer)
    assert runner.run(restore_layer(node, LAYER, 64, said.append)) is not None


def _entry(cache: Path, key: str, size: int, used: float) -> None:
    (cache / f"{key}.stream").write_bytes(b"s" * size)
    (cache / f"{key}.json").write_text("{}")
    os.utime(cache / f"{key}.json", (used, used))


def test_the_bound_drops_the_least_recently_used_entries_but_never_the_one_just_kept(
    tmp_path: Path,
) -> None:
    now = time.time()
    for key, size, age in (("old", 400, 300), ("older", 300, 400), ("recent", 200, 100)):
        _entry(tmp_path, key, size, now - age)
    _entry(tmp_path, "new", 500, now)
    # 1000 bytes: the new entry's 500 and, of the others, what fits in the rest by use.
    assert _prune(tmp_path, 1000, "new") == [("older", 300), ("old", 400)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "new.json", "new.stream", "recent.json", "recent.stream",
    ]  # fmt: skip
    # One entry larger than the bound stays: a build would otherwise store it for nothing.
    assert _prune(tmp_path, 100, "new") == [("recent", 200)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json", "new.stream"]


def test_a_stream_no_record_names_goes_only_once_no_store_can_be_writing_it(
    tmp_path: Path,
) -> None:
    fresh, stale = tmp_path / "fresh.stream", tmp_path / "stale.stream"
    fresh.write_bytes(b"x")
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 2 * 24 * 3600,) * 2)
    assert _prune(tmp_path, 1 << 30, "none") == []
    assert fresh.exists() and not stale.exists()
