"""Templates shipped between nodes (issue 19): built once, sent to the other nodes.

Private to space.node.agent. The same pull as a move (space.node.agent._moves, whose
framing and checks this shares): the source's ``export`` answers a TemplateTicket
(the build's catalog record, the tags naming it, the parents a stream may be
incremental against); the target's ``import_`` reads the source's ``stream`` over the
node API with the ticket alone, into ``incoming/`` staging, and keeps it only once the
SHA-256 the root broker took of what it fed to btrfs receive equals the sender's
trailer and the subvolume holds a template's files and nothing else.

The source streams the template's own read-only subvolume, never a snapshot of it: a
send stream names its subvolume by the UUID it was received from, or else its own, and
the target's copy keeps that as its received UUID. So every copy in the cluster names
the one build made once, and a later move of a sandbox made from any copy is
incremental against any other (_moves._shared_parent).

Parents are the builds the template was built on (its ``base`` chain, nearest first):
the target takes the first it holds. ``base`` is every node's own (imported from its
own guest image, its disk sealed under a fresh LUKS header), so a template built on
``base`` ships whole and one built on a shipped template ships as its difference.

The ready state does not ship: it is a memory image of a VM booted under the source's
QEMU, machine type and accelerator, which another host need not share; the target
makes its own by booting the template once (space.node.agent._ready), as a build does,
before the tags move (a failure is logged: its sandboxes then boot). The build's disk
is sealed with the node key, so only a node with the same key (``key_id``) takes it.

The catalog record is hostile input, checked field by field. A tag moves only to a
build at least as new as the one it names here (``created_at``), so shipments that
overtake each other never move a tag back; a build the node holds already is answered
at once. Whatever fails, nothing of the stream is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import os
import secrets
import stat
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from space.limits import RESOURCES
from space.node.agent._catalog import Build, Catalog
from space.node.agent._moves import (
    STREAM_EXTRA_MIB,
    STREAM_SLACK,
    _Frames,
    _template_subvolumes,
    clear_staging,
    framed,
    new_staging,
)
from space.node.agent._registry import Registry
from space.node.agent._templates import Templates
from space.node.api import (
    Conflict,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TemplateImport,
    TemplateTicket,
)
from space.node.core.run import run
from space.node.core.template import BASE, Shape, Template
from space.node.storage.btrfs import TemplateVolume
from space.node.storage.streams import (
    adopt_received,
    is_read_only_subvolume,
    receive_stream,
    send_stream,
    subvolume_ids,
)
from space.node.templates import parse_ref, ready_from_record

__all__ = ["SHIP_TTL_S", "Shipping", "TemplateSource"]

log = logging.getLogger(__name__)

#: How long a template's ticket is good for.
SHIP_TTL_S = 600.0
#: Most tickets a node holds at once (each a few hundred bytes; expired ones go first).
_MAX_EXPORTS = 256
#: What a template subvolume holds: its files and the mark that says it is complete.
_NEEDED = frozenset({"kernel", "initrd", "rootfs.img", ".complete"})
_MAX_TAGS = 32
_MAX_PARENTS = 16
_MAX_ANCESTORS = 8
_MAX_ENV = 64
_MAX_TEXT = 64 << 10
_BUILD_KEYS = frozenset(
    {"digest", "base", "created_at", "shape", "env", "workdir", "start", "ready_check"}
)


class TemplateSource(Protocol):
    """The source node's API as the target reaches it (a RemoteNode holding the
    ticket as its credential)."""

    def stream_template(
        self, digest: str, ticket: str, parent: str | None
    ) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class _Export:
    digest: str
    path: Path
    expires_at: float
    #: The read-only subvolumes the stream may be against, by stream id.
    parents: dict[str, Path]


class Shipping:
    """Both ends of shipping templates on one node (see the module docstring)."""

    def __init__(
        self,
        registry: Registry,
        templates: Templates,
        remote: Callable[[str, str], TemplateSource],
        key_id: str,
    ) -> None:
        self._registry = registry
        self._templates = templates
        self._remote = remote  # (source_url, ticket) -> the source's node API
        self._key_id = key_id
        #: By the SHA-256 of their tickets: a lookup never compares the secret itself.
        self._exports: dict[str, _Export] = {}

    # the source

    async def export(self, ref: str) -> TemplateTicket:
        """Offer the build ``ref`` names (``name``, ``name:tag``, ``name@digest``).
        Raises InvalidArgument (a malformed ref; ``base``, which every node has of its
        own), NotFound, ResourceExhausted (too many tickets outstanding). Nothing is
        held: the template may be untagged meanwhile (a stream then fails), though
        btrfs refuses to delete a subvolume while it is being sent (the node's next
        start removes it then, as no tag names it)."""
        catalog = self._registry.catalog
        template = catalog.resolve(ref)
        if template.name == BASE:
            raise InvalidArgument("base is every node's own: it is not shipped")
        found = catalog.build_of(template.name, template.digest)
        if found is None:
            raise NotFound(f"no template {ref!r} on this node")
        build, tags = found
        parents = await asyncio.to_thread(_ancestors, catalog, build)
        now = time.time()
        self._exports = {k: e for k, e in self._exports.items() if e.expires_at > now}
        if len(self._exports) >= _MAX_EXPORTS:
            raise ResourceExhausted(f"{_MAX_EXPORTS} template tickets are outstanding")
        ticket = secrets.token_urlsafe(32)
        path = template.volume.path
        self._exports[_key(ticket)] = _Export(build.digest, path, now + SHIP_TTL_S, parents)
        return TemplateTicket(
            name=template.name,
            digest=build.digest,
            tags=tags,
            ticket=ticket,
            expires_at=now + SHIP_TTL_S,
            record=asdict(build),
            parents=list(parents),
            key_id=self._key_id,
            max_stream_bytes=_stream_bound(build.shape),
        )

    async def stream(self, digest: str, ticket: str, parent: str | None) -> AsyncIterator[bytes]:
        """The framed send stream of the build ``digest`` (space.node.agent._moves's
        framing) against ``parent`` (one of the ticket's ``parents``; None: full).
        Raises PermissionDenied (ticket), InvalidArgument (parent) before the first
        frame; a failure later ends the stream without its trailer."""
        export = self._exports.get(_key(ticket))
        if export is None or not hmac.compare_digest(export.digest, digest):
            raise PermissionDenied("no such template ticket")
        if time.time() > export.expires_at:
            raise PermissionDenied("the template ticket has expired")
        parent_path = None if parent is None else export.parents.get(parent)
        if parent is not None and parent_path is None:
            raise InvalidArgument(f"{parent!r} is not a parent of this template")
        frames = framed(send_stream(self._registry.pool.broker, export.path, parent_path))
        async with contextlib.aclosing(frames):
            async for frame in frames:
                yield frame

    # the target

    async def import_(self, ticket: TemplateTicket, source_url: str) -> TemplateImport:
        """Pull the ticket's build from the node at ``source_url``, make its ready
        state and point its tags at it here. Raises InvalidArgument (a malformed
        ticket or record, another node key, a refused stream: bad, short, over its
        bound, failing its checksum, or not a template's files), Conflict (newer
        builds hold every tag it has), Unavailable/PermissionDenied from the source.
        Idempotent: a build here already is answered at once, ``stream_bytes`` 0. On
        any failure or cancellation nothing of the stream is left."""
        name, tags, build = _checked(ticket)
        if not source_url.startswith(("http://", "https://")) or len(source_url) > 2048:
            raise InvalidArgument(f"a source URL is http(s)://host:port, not {source_url[:80]!r}")
        if ticket.key_id != self._key_id:
            raise InvalidArgument(f"template {name} is sealed with another node key")
        catalog = self._registry.catalog
        async with self._registry.lock(f"template/{name}"):
            movable = catalog.newer_tags(name, tags, build)
            held = catalog.build_of(name, build.digest)
            if held is not None:
                template = catalog.resolve(f"{name}@{build.digest}")
                moving = [tag for tag in movable if tag not in held[1]]
                if moving:
                    template = await self._templates.adopt(name, moving, held[0], log.info)
                return TemplateImport(template.info(), 0, None)
            if not movable:
                raise Conflict(f"newer builds of {name} hold every tag of {build.digest[:12]}")
            pool = self._registry.pool
            parent = await asyncio.to_thread(_nearest_parent, pool.root, ticket.parents)
            staging = await new_staging(pool)
            try:
                size = await self._receive(ticket, source_url, parent, staging, name, build)
            finally:
                await asyncio.shield(clear_staging(pool, staging))
            try:
                template = await self._templates.adopt(name, movable, build, log.info)
            except BaseException:  # its ready state, pool and subvolume go
                unnamed = catalog.template(name, "", build)
                await asyncio.shield(self._templates.discard(unnamed))
                raise
            log.info(
                "received template %s@%s: %d bytes, %s",
                name, build.digest[:12], size, f"against {parent}" if parent else "full",
            )  # fmt: skip
            return TemplateImport(template.info(), size, parent)

    async def _receive(
        self,
        ticket: TemplateTicket,
        source_url: str,
        parent: str | None,
        staging: Path,
        name: str,
        build: Build,
    ) -> int:
        """Receive the stream and publish it as ``templates/<name>/<digest>``, read-only
        (keeping its received UUID). Returns the stream's length."""
        pool = self._registry.pool
        source = self._remote(source_url, ticket.ticket)
        try:
            frames = _Frames(source.stream_template(build.digest, ticket.ticket, parent))
            # The target's own bound, whatever the ticket says.
            max_bytes = min(ticket.max_stream_bytes, _stream_bound(build.shape))
            received = await receive_stream(
                pool.broker, pool.root, staging, frames, max_bytes=max_bytes
            )
        finally:
            await source.aclose()
        if frames.trailer != (received.sha256, received.stream_bytes):
            raise InvalidArgument(f"the stream of template {name} failed its checksum")
        # Writable to be moved out of staging (a read-only subvolume cannot change its
        # parent directory), then read-only again: its received UUID stays.
        await adopt_received(pool.broker, received.path, writable=True)
        await asyncio.to_thread(_check_files, received.path, name)
        volume = TemplateVolume(name, build.digest, pool.root / "templates" / name / build.digest)
        await pool.delete_template(volume)  # one a crash left before its record was written
        await asyncio.to_thread(volume.path.parent.mkdir, exist_ok=True)
        await asyncio.to_thread(os.rename, received.path, volume.path)
        try:
            await run("btrfs", "property", "set", "-ts", str(volume.path), "ro", "true")
        except BaseException:
            await asyncio.shield(pool.delete_template(volume))
            raise
        return received.stream_bytes


def _key(ticket: str) -> str:
    return hashlib.sha256(ticket.encode()).hexdigest()


def _stream_bound(shape: Shape) -> int:
    """The most bytes a stream of a template of ``shape`` may take."""
    return int(((shape.disk_mib + STREAM_EXTRA_MIB) << 20) * STREAM_SLACK)


def _base_of(catalog: Catalog, text: str) -> Template | None:
    """The template a build's ``base`` names now, or None."""
    if text.startswith("debian:"):
        return catalog.base
    if text.startswith("template@"):
        return catalog.by_digest(text.removeprefix("template@"))
    if text.startswith("template:"):
        return catalog.find(text.removeprefix("template:"))
    return None


def _ancestors(catalog: Catalog, build: Build) -> dict[str, Path]:
    """The read-only subvolumes ``build`` was built on, nearest first, by stream id:
    any is a correct parent for its stream, and one it shares extents with (every
    ancestor: a build starts from a clone of its base) a small one."""
    found: dict[str, Path] = {}
    text = build.base
    for _ in range(_MAX_ANCESTORS):
        template = _base_of(catalog, text)
        if template is None:
            break
        path = template.volume.path
        with contextlib.suppress(InvalidArgument, OSError):
            if is_read_only_subvolume(path):
                found.setdefault(subvolume_ids(path).stream_id, path)
        held = catalog.build_of(template.name, template.digest)
        if template.name == BASE or held is None:
            break
        text = held[0].base
    return found


def _nearest_parent(pool_root: Path, parents: list[str]) -> str | None:
    """The first of ``parents`` a template subvolume here is (received from it, or it)."""
    here: set[str] = set()
    for _path, ids in _template_subvolumes(pool_root):
        here.update(i for i in (ids.received_uuid, ids.uuid) if i)
    return next((parent for parent in parents[:_MAX_PARENTS] if parent in here), None)


def _check_files(path: Path, name: str) -> None:
    """A received template holds its files, regular, and nothing else. Raises
    InvalidArgument."""
    with os.scandir(path) as entries:
        kinds = {entry.name: entry.stat(follow_symlinks=False).st_mode for entry in entries}
    if set(kinds) != _NEEDED or not all(stat.S_ISREG(mode) for mode in kinds.values()):
        raise InvalidArgument(f"the stream of template {name} holds {sorted(kinds)[:8]}")


def _checked(ticket: TemplateTicket) -> tuple[str, list[str], Build]:
    """The name, tags and build a ticket carries, checked. Raises InvalidArgument."""
    ref = parse_ref(f"{ticket.name}@{ticket.digest}")  # TemplateRefError: InvalidArgument
    if ref.name == BASE:
        raise InvalidArgument("base is every node's own: it is not shipped")
    tags = ticket.tags
    if not 0 < len(tags) <= _MAX_TAGS or not all(isinstance(t, str) for t in tags):
        raise InvalidArgument(f"a template ticket names 1 to {_MAX_TAGS} tags")
    for tag in tags:
        parse_ref(f"{ref.name}:{tag}")
    if not 0 < ticket.max_stream_bytes <= 1 << 40 or len(ticket.parents) > _MAX_PARENTS:
        raise InvalidArgument("a template ticket's bounds are out of range")
    return ref.name, sorted(set(tags)), _build_of(ticket.record, ticket.digest)


def _build_of(data: object, digest: str) -> Build:
    """The catalog record of a build, from another node: hostile until checked."""
    if not isinstance(data, dict) or set(data) != _BUILD_KEYS or data["digest"] != digest:
        raise InvalidArgument(f"a template ticket's record is not build {digest[:12]}'s")
    shape, env = data["shape"], data["env"]
    created_at, base = data["created_at"], data["base"]
    if not isinstance(shape, dict) or set(shape) != {"cpus", "memory_mib", "disk_mib"}:
        raise InvalidArgument("a template record's shape is {cpus, memory_mib, disk_mib}")
    for key, allowed in RESOURCES.items():
        value = shape[key]
        refusal = "not a number" if type(value) is not int else allowed.refusal(key, value)
        if refusal is not None:
            raise InvalidArgument(f"a template record's shape: {refusal}")
    if not isinstance(env, dict) or len(env) > _MAX_ENV:
        raise InvalidArgument(f"a template record's env maps at most {_MAX_ENV} names")
    texts = [base, *env, *env.values()]
    texts += [v for v in (data["workdir"], data["start"]) if v is not None]
    if not all(isinstance(t, str) and len(t) <= _MAX_TEXT and "\0" not in t for t in texts):
        raise InvalidArgument("a template record's texts are strings without NUL, bounded")
    if type(created_at) not in (int, float) or not math.isfinite(created_at) or created_at < 0:
        raise InvalidArgument("a template record's created_at is a time")
    return Build(
        digest=digest,
        base=base,
        created_at=float(created_at),
        shape=Shape(**shape),
        env=dict(env),
        workdir=data["workdir"],
        start=data["start"],
        ready_check=None if data["ready_check"] is None else ready_from_record(data["ready_check"]),
    )
