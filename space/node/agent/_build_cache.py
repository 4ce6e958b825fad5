"""A cache of built layers outside the pool, keyed by content: a template built once on
this host is not built again by a fresh node (a test's, a reinstalled one).

Private to space.node.agent. Off unless ``NodeConfig.build_cache_dir`` is set. After a
build ran steps, the last layer it made is kept there as a btrfs send stream
(``<key>.stream``) with a record written last (``<key>.json``: the layer's digest, the
stream's length and SHA-256). A later build whose last disk step has no layer in the
pool receives it instead of running the steps, and goes on from there (its config, the
ready state) as after any cached layer.

The key is the SHA-256 of the layer's digest (which chains the base image's digest,
the disk size, the template's name and every step: packages by name, copied files by
content, commands, users), the node key's id (a layer's disk is sealed with it) and
the node's apt sources: a package is taken by name from those sources, as the layer
cache in the pool does, so a cache is only as exact as its sources are fixed (a
content-addressed snapshot, or the tests' cached closure). A stream is checked like a
shipped one: the SHA-256 the root broker took of what it fed to btrfs receive must be
the record's, and the subvolume must be the layer it says it is; anything else is
refused, said in the build log and dropped from the cache, and the steps run (their
layer takes the entry's place).

The cache is bounded (``NodeConfig.build_cache_gib``): after a layer is kept, the least
recently used entries (a hit touches its record) are dropped until the rest fit, never
the one just kept; a stream no record names (a store that died between the two) goes
once it is older than any store could be in progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path

from space.node.agent._moves import STREAM_EXTRA_MIB, clear_staging, new_staging
from space.node.agent._registry import Registry
from space.node.api import InvalidArgument, NodeError
from space.node.core.run import run
from space.node.storage.btrfs import TemplateVolume, is_layer_of
from space.node.storage.streams import adopt_received, receive_stream, send_stream

__all__ = ["cache_key", "restore_layer", "store_layer"]

_FORMAT = 1
_MAX_RECORD_BYTES = 4096
_CHUNK_BYTES = 1 << 20
#: A stream without a record older than this is the leftover of a store that died.
_ORPHAN_AGE_S = 24 * 3600.0


def cache_key(digest: str, key_id: str, apt_sources: Sequence[str]) -> str:
    """The cache's name for layer ``digest`` built under the node key ``key_id`` from
    ``apt_sources`` (their order does not matter: apt takes the newest of all)."""
    text = json.dumps(
        {"format": _FORMAT, "layer": digest, "key_id": key_id, "apt_sources": sorted(apt_sources)},
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _key(node: Registry, digest: str) -> str:
    return cache_key(digest, node.keys.key_id, node.config.apt_sources)


async def restore_layer(
    node: Registry, digest: str, disk_mib: int, say: Callable[[str], None]
) -> TemplateVolume | None:
    """The layer ``digest`` received from the cache into the pool, or None (no cache,
    no entry, or an entry refused: said through ``say``). Nothing of a refused entry is
    left in the pool."""
    directory = node.config.build_cache_dir
    if directory is None or node.pool.layer(digest) is not None:
        return node.pool.layer(digest)
    key = _key(node, digest)
    record_path, stream_path = directory / f"{key}.json", directory / f"{key}.stream"
    record = await asyncio.to_thread(_read_record, record_path)
    if record is None or record.get("layer") != digest:
        return None
    say(f"receiving layer {digest[:12]} from the build cache ({record['stream_bytes']} bytes)")
    with contextlib.suppress(OSError):  # used: the last its bound drops
        await asyncio.to_thread(os.utime, record_path)
    try:
        return await _receive(node, digest, stream_path, record, disk_mib)
    except (NodeError, OSError) as exc:
        say(f"the build cache's layer {digest[:12]} is refused ({exc}): building it")
        # Dropped, or every later build would refuse it again: this build keeps the
        # layer it makes in its place (store_layer writes only where no record is).
        await asyncio.to_thread(_drop_entry, record_path, stream_path)
        return None


def _drop_entry(record_path: Path, stream_path: Path) -> None:
    """Remove an entry, its record first (so no reader takes a stream half gone)."""
    for path in (record_path, stream_path):
        with contextlib.suppress(OSError):
            path.unlink()


def _read_record(path: Path) -> dict[str, object] | None:
    try:
        with path.open("rb") as file:
            data = json.loads(file.read(_MAX_RECORD_BYTES + 1)[:_MAX_RECORD_BYTES])
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return None
    if type(data.get("stream_bytes")) is not int or not isinstance(data.get("sha256"), str):
        return None
    return data


async def _receive(
    node: Registry, digest: str, stream_path: Path, record: dict[str, object], disk_mib: int
) -> TemplateVolume:
    pool = node.pool
    max_bytes = (disk_mib + STREAM_EXTRA_MIB) << 20
    staging = await new_staging(pool)
    try:
        # Closed on the way out: a receive refused midway stops reading it.
        async with contextlib.aclosing(_chunks(stream_path)) as chunks:
            received = await receive_stream(
                pool.broker, pool.root, staging, chunks, max_bytes=max_bytes
            )
        if (received.sha256, received.stream_bytes) != (record["sha256"], record["stream_bytes"]):
            raise InvalidArgument("the stream is not the one its record names")
        await adopt_received(pool.broker, received.path, writable=True)
        if not await asyncio.to_thread(is_layer_of, received.path, digest):
            raise InvalidArgument(f"the received subvolume is not layer {digest[:12]}")
        target = pool.root / "layers" / digest
        if await asyncio.to_thread(target.exists):
            raise InvalidArgument(f"{target} exists already")
        await asyncio.to_thread(os.rename, received.path, target)
        await run("btrfs", "property", "set", "-ts", str(target), "ro", "true")
    finally:
        await asyncio.shield(clear_staging(pool, staging))
    layer = pool.layer(digest)
    if layer is None:
        raise InvalidArgument(f"layer {digest[:12]} is not complete after its receive")
    return layer


async def _chunks(path: Path) -> AsyncGenerator[bytes, None]:
    with await asyncio.to_thread(open, path, "rb") as file:
        while chunk := await asyncio.to_thread(file.read, _CHUNK_BYTES):
            yield chunk


async def store_layer(node: Registry, layer: TemplateVolume, say: Callable[[str], None]) -> None:
    """Keep ``layer`` (read-only, in the pool) in the cache, unless there is none or it
    holds it already. A failure is said and changes nothing: the build goes on."""
    directory = node.config.build_cache_dir
    if directory is None:
        return
    key = _key(node, layer.digest)
    record_path, stream_path = directory / f"{key}.json", directory / f"{key}.stream"
    if await asyncio.to_thread(_read_record, record_path) is not None:
        return
    partial = directory / f".{key}.{os.getpid()}.partial"
    try:
        digest, size = hashlib.sha256(), 0
        with await asyncio.to_thread(open, partial, "wb", opener=_private) as file:
            async for chunk in send_stream(node.pool.broker, layer.path, None):
                digest.update(chunk)
                size += len(chunk)
                await asyncio.to_thread(file.write, chunk)
            await asyncio.to_thread(os.fsync, file.fileno())
        await asyncio.to_thread(os.rename, partial, stream_path)
        record = {"format": _FORMAT, "layer": layer.digest, "sha256": digest.hexdigest()}
        await asyncio.to_thread(_write_record, record_path, record | {"stream_bytes": size})
        say(f"kept layer {layer.digest[:12]} in the build cache ({size} bytes)")
        limit = int(node.config.build_cache_gib * (1 << 30))
        for old, old_bytes in await asyncio.to_thread(_prune, directory, limit, key):
            say(f"the build cache dropped entry {old[:12]} ({old_bytes} bytes), unused longest")
    except (NodeError, OSError) as exc:
        say(f"the build cache did not take layer {layer.digest[:12]}: {exc}")
    finally:
        with contextlib.suppress(OSError):
            partial.unlink()


def _prune(directory: Path, max_bytes: int, keep: str) -> list[tuple[str, int]]:
    """Drop the least recently used entries of ``directory`` until the others' streams
    fit in ``max_bytes`` (``keep`` stays whatever its size), and streams no record has
    named for _ORPHAN_AGE_S; returns the (key, stream bytes) of the entries dropped."""
    entries: list[tuple[float, str, int]] = []
    for record_path in directory.glob("*.json"):
        key = record_path.stem
        try:
            used = record_path.stat().st_mtime
            size = (directory / f"{key}.stream").stat().st_size
        except OSError:
            continue
        if key == keep:
            max_bytes -= size
        else:
            entries.append((used, key, size))
    now = time.time()
    for stream_path in directory.glob("*.stream"):
        with contextlib.suppress(OSError):
            orphan = not stream_path.with_suffix(".json").exists()
            if orphan and now - stream_path.stat().st_mtime > _ORPHAN_AGE_S:
                stream_path.unlink()
    total = sum(size for _, _, size in entries)
    dropped = []
    for _, key, size in sorted(entries):
        if total <= max_bytes:
            break
        _drop_entry(directory / f"{key}.json", directory / f"{key}.stream")
        total -= size
        dropped.append((key, size))
    return dropped


def _write_record(path: Path, record: dict[str, object]) -> None:
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "w", opener=_private) as file:
        json.dump(record, file)
        file.flush()
        os.fsync(file.fileno())
    os.rename(partial, path)


def _private(path: str, flags: int) -> int:
    """Open as ``open`` does, but 0600: a layer is a tenant's template."""
    return os.open(path, flags, 0o600)
