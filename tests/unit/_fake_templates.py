"""FakeNode's templates: scripted builds from a real build-context archive.

A build unpacks the tar (plain or gzip) it is given, reads ``name``, ``tag`` and
``base`` from its ``space.toml`` and answers a few log lines then BuildSucceeded; a spec
containing ``fail`` fails at step 1 instead. Digests hash the files and the spec less
its name and tag, as the real node's do not depend on the name either.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import time
import tomllib
from collections.abc import AsyncIterable, AsyncIterator

from space.node.api import (
    BuildEvent,
    BuildFailed,
    BuildLog,
    BuildSucceeded,
    Conflict,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    TemplateImport,
    TemplateInfo,
    TemplateTicket,
    Unavailable,
)

__all__ = ["BASE_DIGEST", "FakeBuildStream", "FakeTemplates"]

BASE_DIGEST = "ba5e" * 16
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
_BASE = TemplateInfo("base", "latest", BASE_DIGEST, 1.0, "debian:bookworm", 1, 256, 2048)


class FakeBuildStream:
    def __init__(self, build_id: str, events: list[BuildEvent]) -> None:
        self.build_id = build_id
        self._events = events
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[BuildEvent]:
        for event in self._events:
            yield event

    async def aclose(self) -> None:
        self.closed = True


def _unpack(data: bytes) -> dict[str, bytes | None]:
    """Entries by name (None for a directory); InvalidArgument as the node would."""
    entries: dict[str, bytes | None] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
            for member in archive:
                if member.isdir():
                    entries[member.name] = None
                elif member.isfile():
                    entries[member.name] = archive.extractfile(member).read()  # type: ignore[union-attr]
                else:
                    raise InvalidArgument(f"{member.name}: not a file or directory")
    except tarfile.TarError as exc:
        raise InvalidArgument(f"not a tar archive: {exc}") from exc
    return entries


class FakeTemplates:
    """The three template methods of NodeService, in memory. ``contexts`` keeps each
    build's unpacked entries; ``templates`` is keyed by (name, tag)."""

    def __init__(self) -> None:
        self.templates: dict[tuple[str, str], TemplateInfo] = {("base", "latest"): _BASE}
        self.contexts: list[dict[str, bytes | None]] = []
        self.build_streams: list[FakeBuildStream] = []
        #: Template tickets outstanding: ticket to digest.
        self.template_tickets: dict[str, str] = {}

    async def build_template(self, context: AsyncIterable[bytes]) -> FakeBuildStream:
        entries = _unpack(b"".join([chunk async for chunk in context]))
        self.contexts.append(entries)
        spec_bytes = entries.get("space.toml")
        if spec_bytes is None:
            raise InvalidArgument("space.toml: missing from the build context")
        spec = tomllib.loads(spec_bytes.decode())
        name = str(spec.get("name", ""))
        if not _NAME_RE.fullmatch(name):
            raise InvalidArgument(f"space.toml: name: {name!r} must match the name pattern")
        base = str(spec.get("base", ""))
        self._check_base(base)
        stream = FakeBuildStream(f"b{len(self.build_streams)}", self._script(spec, entries))
        self.build_streams.append(stream)
        return stream

    def _check_base(self, base: str) -> None:
        if base.startswith("template:"):
            name, _, tag = base.removeprefix("template:").partition(":")
            if (name, tag) not in self.templates:
                raise NotFound(f"no template {name}:{tag}")
        elif base.startswith("template@"):
            digest = base.removeprefix("template@")
            if all(info.digest != digest for info in self.templates.values()):
                raise NotFound(f"no template with digest {digest}")

    def _script(
        self, spec: dict[str, object], entries: dict[str, bytes | None]
    ) -> list[BuildEvent]:
        name, tag = str(spec["name"]), str(spec.get("tag", "latest"))
        logs: list[BuildEvent] = [BuildLog(f"step 1/2 run: building {name}:{tag}")]
        if "fail" in json.dumps(spec):
            return [*logs, BuildLog("boom"), BuildFailed("build_failed", f"{name}: step failed", 1)]
        hashed = {k: v for k, v in spec.items() if k not in ("name", "tag")}
        files = sorted((k, (v or b"").hex()) for k, v in entries.items() if k != "space.toml")
        digest = hashlib.sha256(json.dumps([hashed, files]).encode()).hexdigest()
        resources = spec.get("resources", {})
        assert isinstance(resources, dict)
        info = TemplateInfo(
            name, tag, digest, time.time(), str(spec["base"]),
            resources.get("cpus", 1), resources.get("memory_mib", 256),
            resources.get("disk_mib", 2048),
        )  # fmt: skip
        self.templates[(name, tag)] = info
        return [*logs, BuildLog("step 2/2 config: done"), BuildSucceeded(info)]

    async def list_templates(self) -> list[TemplateInfo]:
        return [self.templates[key] for key in sorted(self.templates)]

    async def delete_template(self, ref: str) -> None:
        name = re.split("[:@]", ref)[0]
        if name == "base":
            raise Conflict("base cannot be deleted")
        if "@" in ref:
            digest = ref.partition("@")[2]
            keys = [k for k, v in self.templates.items() if k[0] == name and v.digest == digest]
        else:
            keys = [(name, ref.partition(":")[2] or "latest")]
        found = [key for key in keys if key in self.templates]
        if not found:
            raise NotFound(f"no template {ref}")
        for key in found:
            del self.templates[key]

    def has_template(self, ref: str) -> bool:
        """Whether a sandbox may be created from ``ref`` (``name``, ``name:tag``, ``name@d``)."""
        if "@" in ref:
            name, _, digest = ref.partition("@")
            return any(k[0] == name and v.digest == digest for k, v in self.templates.items())
        name, _, tag = ref.partition(":")
        return (name, tag or "latest") in self.templates

    async def export_template(self, ref: str) -> TemplateTicket:
        name, _, digest = ref.partition("@")
        tags = sorted(
            k[1] for k, v in self.templates.items() if k[0] == name and v.digest == digest
        )
        if name == "base":
            raise InvalidArgument("base is every node's own")
        if not tags:
            raise NotFound(f"no template {ref}")
        ticket = f"ticket-{len(self.template_tickets)}-{digest[:8]}"
        self.template_tickets[ticket] = digest
        return TemplateTicket(
            name=name,
            digest=digest,
            tags=tags,
            ticket=ticket,
            expires_at=time.time() + 600,
            record={"digest": digest},
            parents=[],
            key_id="key",
            max_stream_bytes=1 << 20,
        )

    async def stream_template(
        self, digest: str, ticket: str, parent: str | None
    ) -> AsyncIterator[bytes]:
        if self.template_tickets.get(ticket) != digest:
            raise PermissionDenied("no such template ticket")
        yield b"a template's stream"

    async def import_template(self, ticket: TemplateTicket, source_url: str) -> TemplateImport:
        raise Unavailable("the fake node imports nothing")
