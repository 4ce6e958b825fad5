"""The templates of a node by reference: ``base`` and every tag of every built template.

Private to space.node.agent. A built template's builds and tags are kept in one JSON record
per name (``data_dir/templates/<name>.json``); the record is replaced atomically, so a
tag moves to a new build only once that build is complete, and a failed build leaves
it where it was. The subvolumes themselves are in the pool (space.node.storage.btrfs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from space.node.api import Conflict, InvalidArgument, NotFound
from space.node.core.state import _JsonDir
from space.node.core.template import BASE, Shape, Template, image_mib
from space.node.storage.btrfs import BtrfsPool
from space.node.templates import ReadyCheck, parse_ref, ready_from_record

__all__ = ["Build", "Catalog"]

_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Build:
    """What a completed build of a template is, beyond its subvolume."""

    digest: str
    base: str
    created_at: float
    shape: Shape
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    start: str | None = None
    ready_check: ReadyCheck | None = None


@dataclass(frozen=True, slots=True)
class _Record:
    name: str
    tags: dict[str, str]
    builds: dict[str, Build]

    def to_json(self) -> dict[str, Any]:
        builds = {digest: asdict(build) for digest, build in self.builds.items()}
        return {"version": _FORMAT_VERSION, "name": self.name, "tags": self.tags, "builds": builds}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> _Record:
        if data.get("version") != _FORMAT_VERSION:
            raise ValueError(f"unknown template record version {data.get('version')!r}")
        builds = {}
        for digest, raw in dict(data["builds"]).items():
            raw = dict(raw, shape=Shape(**raw["shape"]))
            if raw.get("ready_check") is not None:
                raw["ready_check"] = ready_from_record(raw["ready_check"])
            builds[str(digest)] = Build(**raw)
        return cls(str(data["name"]), {str(k): str(v) for k, v in data["tags"].items()}, builds)


class Catalog:
    """``base`` and the built templates, resolved by reference. Not thread-safe; the node
    serialises builds and deletions of a name."""

    def __init__(self, base: Template, pool: BtrfsPool, directory: Path) -> None:
        self.base = base
        self._pool = pool
        self._store: _JsonDir[_Record] = _JsonDir(
            directory, _Record.from_json, _Record.to_json, lambda r: r.name
        )
        self._records: dict[str, _Record] = {}
        #: Ready-state volumes by template digest, once made.
        self._ready: dict[str, Path] = {}
        self._gvisor_ready: dict[str, Path] = {}

    def load(self) -> list[str]:
        """Read the records; builds whose subvolume is gone are dropped. Returns what
        was dropped, for the start-up log."""
        dropped = []
        records, bad = self._store.load_all()
        dropped += [f"unreadable template record {path.name}" for path in bad]
        for record in records:
            kept = {d: b for d, b in record.builds.items() if self._volume_exists(record.name, d)}
            dropped += [
                f"template {record.name}@{d}: subvolume gone"
                for d in record.builds
                if d not in kept
            ]
            tags = {t: d for t, d in record.tags.items() if d in kept}
            self._records[record.name] = _Record(record.name, tags, kept)
        return dropped

    def resolve(self, text: str) -> Template:
        """The template ``text`` names: ``name``, ``name:tag`` or ``name@digest``.

        Raises InvalidArgument (not a reference) or NotFound.
        """
        ref = parse_ref(text)
        if ref.name == BASE:
            if ref.tag in (None, self.base.tag) and ref.digest in (None, self.base.digest):
                return self._with_ready(self.base)
            raise NotFound(f"no template {text!r} on this node")
        record = self._records.get(ref.name)
        digest = ref.digest if ref.tag is None else record.tags.get(ref.tag) if record else None
        if record is None or digest not in record.builds:
            raise NotFound(f"no template {text!r} on this node")
        tag = ref.tag or next((t for t, d in sorted(record.tags.items()) if d == digest), "")
        return self._template(record.name, tag, record.builds[digest])

    def by_digest(self, digest: str) -> Template | None:
        """The build ``digest`` under one of its tags (any name), or None."""
        return next((t for t in self.tagged() if t.digest == digest), None)

    def find(self, text: str) -> Template | None:
        try:
            return self.resolve(text)
        except (NotFound, InvalidArgument):
            return None

    def tagged(self) -> list[Template]:
        """Every tag of every template, ``base:latest`` first, then by name and tag."""
        found = [self._with_ready(self.base)]
        for name in sorted(self._records):
            record = self._records[name]
            for tag in sorted(record.tags):
                found.append(self._template(name, tag, record.builds[record.tags[tag]]))
        return found

    def builds(self) -> list[Template]:
        """Every build once (the ones a tag names), ``base`` first."""
        seen: dict[str, Template] = {}
        for template in self.tagged():
            seen.setdefault(template.digest, template)
        return list(seen.values())

    def add(
        self, name: str, tag: str, build: Build, *, more_tags: tuple[str, ...] = ()
    ) -> tuple[Template, list[Template]]:
        """Record a complete build of ``name`` and point ``tag`` (and ``more_tags``) at
        it (durably).

        Returns the template and the builds no tag names any more (the one the tag
        named before, unless another tag still does), for the caller to delete.
        """
        record = self._records.get(name) or _Record(name, {}, {})
        tags = {**record.tags, **dict.fromkeys((tag, *more_tags), build.digest)}
        builds = {**record.builds, build.digest: build}
        named = set(tags.values())
        record = _Record(name, tags, {d: b for d, b in builds.items() if d in named})
        self._store.save(record)
        self._records[name] = record
        orphans = [self._template(name, "", b) for d, b in builds.items() if d not in named]
        return self._template(name, tag, build), orphans

    def build_of(self, name: str, digest: str) -> tuple[Build, list[str]] | None:
        """The build ``digest`` of ``name`` and the tags naming it, or None."""
        record = self._records.get(name)
        if record is None or digest not in record.builds:
            return None
        return record.builds[digest], sorted(t for t, d in record.tags.items() if d == digest)

    def newer_tags(self, name: str, tags: list[str], build: Build) -> list[str]:
        """Which of ``tags`` a received ``build`` of ``name`` may take: those naming no
        build here, or an older one (by ``created_at``), or it already. So builds
        shipped out of order never move a tag back (issue 19)."""
        record = self._records.get(name)
        held = {} if record is None else record.tags
        builds = {} if record is None else record.builds
        return [
            tag
            for tag in tags
            if tag not in held or builds[held[tag]].created_at <= build.created_at
        ]

    def template(self, name: str, tag: str, build: Build) -> Template:
        """``build`` of ``name`` as a Template (its subvolume published), tagged or not."""
        return self._template(name, tag, build)

    def remove(self, text: str) -> list[Template]:
        """Untag ``text`` (``name``/``name:tag``: that tag; ``name@digest``: every tag of
        that build). Returns the builds no tag names any more, for the caller to delete.

        Raises Conflict for ``base``, InvalidArgument, NotFound.
        """
        ref = parse_ref(text)
        if ref.name == BASE:
            raise Conflict("the base template cannot be deleted")
        record = self._records.get(ref.name)
        target = self.resolve(text)  # NotFound first
        assert record is not None
        if ref.tag is not None:
            tags = {t: d for t, d in record.tags.items() if t != ref.tag}
        else:
            tags = {t: d for t, d in record.tags.items() if d != target.digest}
        orphans = [b for d, b in record.builds.items() if d not in tags.values()]
        builds = {d: b for d, b in record.builds.items() if d in tags.values()}
        if tags:
            self._records[ref.name] = _Record(ref.name, tags, builds)
            self._store.save(self._records[ref.name])
        else:
            del self._records[ref.name]
            self._store.remove(ref.name)
        return [self._template(ref.name, "", build) for build in orphans]

    def set_ready(self, digest: str, path: Path | None, guest: str = "qemu") -> None:
        ready = self._ready if guest == "qemu" else self._gvisor_ready
        if path is None:
            ready.pop(digest, None)
        else:
            ready[digest] = path

    def _template(self, name: str, tag: str, build: Build) -> Template:
        volume = self._pool.template(name, build.digest)
        template = Template(
            name=name,
            tag=tag,
            volume=volume,
            kernel_cmdline=self.base.kernel_cmdline,
            min_disk_mib=image_mib(volume),
            pristine=False,
            shape=build.shape,
            base=build.base,
            created_at=build.created_at,
            env=dict(build.env),
            workdir=build.workdir,
            start=build.start,
            ready_check=build.ready_check,
        )
        return self._with_ready(template)

    def _with_ready(self, template: Template) -> Template:
        return replace(
            template,
            ready=self._ready.get(template.digest),
            gvisor_ready=self._gvisor_ready.get(template.digest),
        )

    def _volume_exists(self, name: str, digest: str) -> bool:
        try:
            self._pool.template(name, digest)
        except (NotFound, InvalidArgument):
            return False
        return True
