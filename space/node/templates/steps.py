"""A spec's build plan: ordered steps, each keyed by a digest of everything up to it.

The plan of a spec is, in order:

    packages   one step installing the sorted, deduplicated packages (none: no step)
    copy       one step per copy, with the resolved, hashed list of what it copies
    run        one step per run command
    config     env, workdir, start, ready check and resources; always last

A step's digest is the sha256 of its parent's digest (the previous step's, or the base's
for the first), its kind and its canonical content, and, for a copy, one record per
copied file or directory (relative path, kind, mode, content sha256) in sorted order. So
changing step k changes the digests of k and every later step and none before, and the
same inputs give the same digests whatever the order of the env table, the package list
or the directory listings. A copy's ``src`` is not hashed, only what it copies: renaming
a source directory rebuilds nothing. The template's digest is the last step's.

A builder keeps each step's result keyed by its digest and starts from the last step
whose result it already has.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from space.node.templates._fields import Where, index
from space.node.templates._tree import CopyEntry, list_source
from space.node.templates.errors import TemplateSpecError
from space.node.templates.refs import DIGEST_RE
from space.node.templates.spec import CopyStep, RunStep, TemplateConfig, TemplateSpec

__all__ = [
    "STEP_FORMAT",
    "Action",
    "CopyEntry",
    "CopyPlan",
    "Packages",
    "Step",
    "StepKind",
    "describe",
    "plan",
    "template_digest",
]

#: Hashed into every step: bump it when the canonical content of a step changes meaning.
STEP_FORMAT = "space.template.step/1"
StepKind = Literal["packages", "copy", "run", "config"]


@dataclass(frozen=True, slots=True)
class Packages:
    """Debian packages to install, sorted and without duplicates."""

    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """What one copy step puts at ``dst``: every entry, by path component (parents first)."""

    src: str
    dst: str
    files: tuple[CopyEntry, ...]


Action = Packages | CopyPlan | RunStep | TemplateConfig


@dataclass(frozen=True, slots=True)
class Step:
    #: Position in the plan, from 0.
    index: int
    kind: StepKind
    #: Where the step comes from in the spec: "packages", "steps[2]" or "config".
    key: str
    description: str
    #: The previous step's digest, or the base's for the first step.
    parent: str
    digest: str
    #: What to do: Packages, CopyPlan, RunStep or TemplateConfig, by ``kind``.
    action: Action


def plan(spec: TemplateSpec, spec_dir: Path, base_digest: str) -> list[Step]:
    """The build steps of ``spec``, copy sources taken relative to ``spec_dir``.

    Reads and hashes every copied file (streamed, never whole). Raises TemplateSpecError
    (``file`` None) for a ``base_digest`` that is not 64 lowercase hex digits, or a copy
    source that is missing, unreadable, leaves ``spec_dir`` or breaks a copy limit.
    Changes nothing; the same inputs always give the same plan.
    """
    if not isinstance(base_digest, str) or not DIGEST_RE.fullmatch(base_digest):
        raise TemplateSpecError(None, "base", f"base digest {base_digest!r} is not sha256 hex")
    steps: list[Step] = []
    parent = base_digest
    for kind, key, action in _actions(spec, spec_dir):
        digest = _digest(parent, kind, action)
        steps.append(Step(len(steps), kind, key, _description(action), parent, digest, action))
        parent = digest
    return steps


def template_digest(steps: Sequence[Step]) -> str:
    """The digest of the template a plan builds: its last step's."""
    return steps[-1].digest


def describe(steps: Sequence[Step]) -> list[str]:
    """One line per step for build logs: position, kind, short digest, what it does."""
    total = len(steps)
    return [
        f"step {step.index + 1}/{total} {step.kind} {step.digest[:12]}: {step.description}"
        for step in steps
    ]


def _actions(spec: TemplateSpec, spec_dir: Path) -> Iterator[tuple[StepKind, str, Action]]:
    names = tuple(sorted(set(spec.packages)))
    if names:
        yield "packages", "packages", Packages(names)
    where = Where(None)
    for position, step in enumerate(spec.steps):
        key = index("steps", position)
        if isinstance(step, CopyStep):
            files = list_source(where, spec_dir, step.src, f"{key}.copy.src")
            _check_copy_target(where, step, files, key)
            yield "copy", key, CopyPlan(step.src, step.dst, files)
        else:
            yield "run", key, step
    yield "config", "config", spec.config


def _check_copy_target(
    where: Where, step: CopyStep, files: tuple[CopyEntry, ...], key: str
) -> None:
    if step.dst == "/" and files[0].kind == "file":
        where.fail(f"{key}.copy.dst", "a file cannot be copied to '/'")


def _digest(parent: str, kind: StepKind, action: Action) -> str:
    digest = hashlib.sha256()
    header = {"format": STEP_FORMAT, "parent": parent, "kind": kind, "content": _content(action)}
    digest.update(_canonical(header))
    if isinstance(action, CopyPlan):
        for entry in action.files:
            record = {"path": entry.path, "kind": entry.kind, "mode": entry.mode}
            digest.update(_canonical(record | {"sha256": entry.sha256}))
    return digest.hexdigest()


def _content(action: Action) -> dict[str, object]:
    """The canonical content of a step, as JSON-ready values."""
    if isinstance(action, Packages):
        return {"packages": list(action.names)}
    if isinstance(action, CopyPlan):
        return {"dst": action.dst}
    if isinstance(action, RunStep):
        return {"run": action.command, "user": action.user}
    resources = action.resources
    content: dict[str, object] = {
        "env": dict(action.env),
        "workdir": action.workdir,
        "start": action.start,
        "resources": {
            "cpus": resources.cpus,
            "memory_mib": resources.memory_mib,
            "disk_mib": resources.disk_mib,
        },
    }
    if action.ready is not None:  # absent when unset: digests of specs without one stay
        content["ready"] = asdict(action.ready)
    return content


def _canonical(value: Mapping[str, object]) -> bytes:
    # One JSON line: sorted keys, no spaces, ASCII; newlines inside strings are escaped,
    # so records cannot run into each other.
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return text.encode("ascii") + b"\n"


def _description(action: Action) -> str:
    if isinstance(action, Packages):
        return f"install {len(action.names)} packages: {' '.join(action.names)}"
    if isinstance(action, CopyPlan):
        count = sum(entry.kind == "file" for entry in action.files)
        size = sum(entry.size for entry in action.files)
        return f"copy {action.src} -> {action.dst} ({count} files, {size} bytes)"
    if isinstance(action, RunStep):
        return f"run as {action.user}: {_shorten(action.command)}"
    return "config: " + ", ".join(_config_parts(action))


def _config_parts(config: TemplateConfig) -> list[str]:
    parts = [f"env {len(config.env)} variables"]
    if config.workdir is not None:
        parts.append(f"workdir {config.workdir}")
    if config.start is not None:
        parts.append(f"start {_shorten(config.start)}")
    if config.ready is not None:
        parts.append(f"ready {_shorten(config.ready.describe())}")
    for name in ("cpus", "memory_mib", "disk_mib"):
        value = getattr(config.resources, name)
        if value is not None:
            parts.append(f"{name} {value}")
    return parts


def _shorten(command: str, limit: int = 100) -> str:
    """The first line of ``command``, at most ``limit`` characters, marked if cut."""
    line = command.strip().splitlines()[0]
    cut = len(line) > limit or line != command.strip()
    return (line[:limit] + " ...") if cut else line
