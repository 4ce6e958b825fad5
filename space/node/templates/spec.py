"""Template specs: a TOML file saying how to build a template (issue 4).

    name = "py-data"                 # [a-z0-9][a-z0-9_.-]{0,63}
    tag = "v1"                       # optional, default "latest", same pattern
    base = "debian:bookworm"         # or "template:<name>:<tag>" or "template@<digest>"
    packages = ["python3-numpy"]     # Debian package names, at most 256
    env = { LANG = "C.UTF-8" }       # at most 256 entries, for the sandboxes
    workdir = "/home/user/work"      # optional, absolute
    start = "python3 -m http.server" # optional; runs at boot and stays running
    [ready]                          # optional, with start: polled in the guest before
    http = { port = 8000, path = "/" }  # the ready state is saved; or command = "..."
    timeout_s = 300                  # 1..1800, default 300
    [resources]                      # optional defaults: cpus 1..8,
    cpus = 1                         #   memory_mib 128..16384, disk_mib 1024..65536
    [build_egress]                   # optional: the build VM's network for run steps
    allow = [{ domain = "pypi.org" }] # an egress policy (space.node.api.egress_policy)
    [[steps]]                        # at most 64, in order, each one of:
    copy = { src = "app/", dst = "/opt/app" }   # src relative to the spec's directory
    [[steps]]
    run = "pip install -r /opt/app/requirements.txt"  # /bin/sh -c, at most 16 KiB
    user = "root"                    # optional, run steps only

Reading is strict: an unknown key, a wrong type, a bad name, a copy source that is
absolute, contains ``..`` or resolves outside the spec's directory (symlinks included), a
relative destination, an empty command or a value past a limit raises TemplateSpecError
naming the file and the key path (``steps[2].copy.src``, indices from 0). Nothing is
built here: space.node.templates.steps turns a spec into hashed build steps.
See docs/templates.md.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from space.limits import RESOURCES
from space.node.api import EgressPolicy, InvalidArgument
from space.node.templates._fields import Where, absolute_path, child, index
from space.node.templates._tree import resolve_source
from space.node.templates.errors import TemplateSpecError
from space.node.templates.refs import DEFAULT_TAG, DIGEST_RE, NAME_RE

__all__ = [
    "MAX_COMMAND_BYTES",
    "MAX_ENV_ENTRIES",
    "MAX_PACKAGES",
    "MAX_READY_TIMEOUT_S",
    "MAX_SPEC_BYTES",
    "MAX_STEPS",
    "Base",
    "CopyStep",
    "DebianBase",
    "DigestBase",
    "ReadyCheck",
    "Resources",
    "RunStep",
    "SpecStep",
    "TemplateBase",
    "TemplateConfig",
    "TemplateSpec",
    "load_spec",
    "parse_ready",
    "parse_spec",
    "ready_from_record",
]

# Limits of issue 4; resources are the contract's (space.limits).
MAX_STEPS = 64
MAX_PACKAGES = 256
MAX_COMMAND_BYTES = 16 * 1024
MAX_ENV_ENTRIES = 256
MAX_ENV_VALUE_BYTES = 4096
#: The spec file itself: room for every command and env value at their limits.
MAX_SPEC_BYTES = 4 << 20
_MAX_PATH_BYTES = 4096
#: A ready check's deadline (default and limit): a build VM waits at most this long.
DEFAULT_READY_TIMEOUT_S = 300
MAX_READY_TIMEOUT_S = 1800
# An HTTP ready check's path: absolute, printable ASCII without spaces (RFC 3986 chars).
_HTTP_PATH_RE = re.compile(r"/[!-~]{0,1023}")

# Debian policy 5.6.7: lowercase letters, digits, "+", "-", "."; two or more characters.
_PACKAGE_RE = re.compile(r"[a-z0-9][a-z0-9+.-]{1,127}")
_RELEASE_RE = re.compile(r"[a-z][a-z0-9-]{1,31}")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
# useradd's default NAME_REGEX, without the trailing "$" of machine accounts.
_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_TOP_KEYS = (
    "name",
    "tag",
    "base",
    "packages",
    "env",
    "workdir",
    "start",
    "resources",
    "ready",
    "build_egress",
    "steps",
)


@dataclass(frozen=True, slots=True)
class DebianBase:
    """Start from a Debian release (a codename such as ``bookworm``)."""

    release: str

    def __str__(self) -> str:
        return f"debian:{self.release}"


@dataclass(frozen=True, slots=True)
class TemplateBase:
    """Start from another template, by name and tag."""

    name: str
    tag: str

    def __str__(self) -> str:
        return f"template:{self.name}:{self.tag}"


@dataclass(frozen=True, slots=True)
class DigestBase:
    """Start from one exact template build, by its digest."""

    digest: str

    def __str__(self) -> str:
        return f"template@{self.digest}"


Base = DebianBase | TemplateBase | DigestBase


@dataclass(frozen=True, slots=True)
class CopyStep:
    """Copy ``src`` (a file or directory, relative to the spec's directory) to ``dst``.

    ``dst`` is the absolute guest path the source becomes: a directory's contents land
    in ``dst``, a file is written as ``dst``.
    """

    src: str
    dst: str


@dataclass(frozen=True, slots=True)
class RunStep:
    """Run ``command`` with ``/bin/sh -c`` as ``user`` inside the build VM."""

    command: str
    user: str = "root"


SpecStep = CopyStep | RunStep


@dataclass(frozen=True, slots=True)
class Resources:
    """Default resources of the template's sandboxes; None leaves the node's default."""

    cpus: int | None = None
    memory_mib: int | None = None
    disk_mib: int | None = None


@dataclass(frozen=True, slots=True)
class ReadyCheck:
    """When a template's start command has become ready: polled in the guest after the
    start command, before the ready state is saved (space.node.agent._hidden's
    ``wait_ready``).

    Exactly one of ``command`` (``/bin/sh -c`` as the template's user exits 0) and
    ``http_port``/``http_path`` (a GET of ``http://127.0.0.1:<port><path>`` in the guest
    answers 2xx); ``timeout_s`` bounds the wait, after which the build fails.
    """

    command: str | None = None
    http_port: int | None = None
    http_path: str | None = None
    timeout_s: int = DEFAULT_READY_TIMEOUT_S

    def describe(self) -> str:
        what = (
            self.command if self.command is not None else f"GET :{self.http_port}{self.http_path}"
        )
        return f"{what} (within {self.timeout_s} s)"


@dataclass(frozen=True, slots=True)
class TemplateConfig:
    """What a sandbox of the template starts with; the build's final step."""

    #: Environment variables, sorted by name.
    env: tuple[tuple[str, str], ...] = ()
    workdir: str | None = None
    #: Started at boot and kept running.
    start: str | None = None
    resources: Resources = field(default_factory=Resources)
    #: Polled after ``start`` before the ready state is saved; needs ``start``.
    ready: ReadyCheck | None = None


@dataclass(frozen=True, slots=True)
class TemplateSpec:
    name: str
    base: Base
    tag: str = DEFAULT_TAG
    #: As written (space.node.templates.steps sorts and deduplicates them).
    packages: tuple[str, ...] = ()
    steps: tuple[SpecStep, ...] = ()
    config: TemplateConfig = field(default_factory=TemplateConfig)
    #: The build VM's egress policy while run steps run (closed: no network). Not part
    #: of any digest: what a step fetched is kept in its layer like anything else.
    build_egress: EgressPolicy = field(default_factory=EgressPolicy)


def load_spec(path: Path) -> TemplateSpec:
    """Read and check the spec file at ``path`` (copy sources relative to its directory).

    Raises TemplateSpecError for every problem, an unreadable or oversized file included.
    Reads at most MAX_SPEC_BYTES + 1 bytes; changes nothing.
    """
    try:
        with path.open("rb") as stream:
            data = stream.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise TemplateSpecError(path, "", f"cannot be read: {exc.strerror or exc}") from exc
    if len(data) > MAX_SPEC_BYTES:
        raise TemplateSpecError(path, "", f"larger than {MAX_SPEC_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TemplateSpecError(path, "", f"not UTF-8: {exc}") from exc
    return parse_spec(text, spec_dir=path.parent, file=path)


def parse_spec(text: str, *, spec_dir: Path, file: Path | None = None) -> TemplateSpec:
    """Check the TOML ``text`` of a spec whose copy sources are relative to ``spec_dir``.

    ``file`` only names the spec in errors. Raises TemplateSpecError; changes nothing.
    """
    where = Where(file)
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TemplateSpecError(file, "", f"not valid TOML: {exc}") from exc
    top = where.table(document, "", _TOP_KEYS)
    for key in ("name", "base"):
        if key not in top:
            where.fail(key, "is required")
    return TemplateSpec(
        name=where.string(top["name"], "name", max_bytes=64, pattern=NAME_RE),
        tag=where.string(top.get("tag", DEFAULT_TAG), "tag", max_bytes=64, pattern=NAME_RE),
        base=_base(where, top["base"]),
        packages=_packages(where, top.get("packages", [])),
        steps=_steps(where, top.get("steps", []), spec_dir),
        config=_config(where, top),
        build_egress=_build_egress(where, top.get("build_egress", {})),
    )


def _build_egress(where: Where, value: object) -> EgressPolicy:
    table = where.table(value, "build_egress", ("allow",))
    try:
        return EgressPolicy.parse(table)
    except InvalidArgument as exc:
        key, sep, problem = exc.message.partition(": ")  # "allow[2].ports[0]: ..."
        if not sep:
            where.fail("build_egress", exc.message)
        where.fail(f"build_egress.{key}", problem)


def _base(where: Where, value: object) -> Base:
    text = where.string(value, "base", max_bytes=256)
    kind, _, rest = text.partition(":")
    if kind == "debian" and _RELEASE_RE.fullmatch(rest):
        return DebianBase(release=rest)
    name, _, tag = rest.partition(":")
    if kind == "template" and NAME_RE.fullmatch(name) and NAME_RE.fullmatch(tag):
        return TemplateBase(name=name, tag=tag)
    kind, _, digest = text.partition("@")
    if kind == "template" and DIGEST_RE.fullmatch(digest):
        return DigestBase(digest=digest)
    where.fail(
        "base",
        f"{text!r} is none of 'debian:<release>', 'template:<name>:<tag>', "
        "'template@<64 lowercase hex digest>'",
    )


def _packages(where: Where, value: object) -> tuple[str, ...]:
    items = where.array(value, "packages", MAX_PACKAGES)
    return tuple(
        where.string(item, index("packages", i), max_bytes=128, pattern=_PACKAGE_RE)
        for i, item in enumerate(items)
    )


def _steps(where: Where, value: object, spec_dir: Path) -> tuple[SpecStep, ...]:
    items = where.array(value, "steps", MAX_STEPS)
    return tuple(_step(where, item, index("steps", i), spec_dir) for i, item in enumerate(items))


def _step(where: Where, value: object, key: str, spec_dir: Path) -> SpecStep:
    table = where.table(value, key, ("copy", "run", "user"))
    if ("copy" in table) == ("run" in table):
        where.fail(key, "a step holds exactly one of 'copy' or 'run'")
    if "run" in table:
        command = where.command(table["run"], child(key, "run"), MAX_COMMAND_BYTES)
        user = table.get("user", "root")
        return RunStep(
            command, where.string(user, child(key, "user"), max_bytes=32, pattern=_USER_RE)
        )
    if "user" in table:
        where.fail(child(key, "user"), "applies to run steps only")
    return _copy(where, table["copy"], child(key, "copy"), spec_dir)


def _copy(where: Where, value: object, key: str, spec_dir: Path) -> CopyStep:
    table = where.table(value, key, ("src", "dst"))
    for name in ("src", "dst"):
        if name not in table:
            where.fail(child(key, name), "is required")
    src_key = child(key, "src")
    src = where.string(table["src"], src_key, max_bytes=_MAX_PATH_BYTES)
    if not src:
        where.fail(src_key, "must not be empty (use '.' for the spec's directory)")
    resolve_source(where, spec_dir, src, src_key)
    return CopyStep(src=src, dst=absolute_path(where, table["dst"], child(key, "dst")))


def _config(where: Where, top: dict[str, object]) -> TemplateConfig:
    workdir, start, ready = top.get("workdir"), top.get("start"), top.get("ready")
    if ready is not None and start is None:
        where.fail("ready", "needs a start command to wait for")
    return TemplateConfig(
        env=_env(where, top.get("env", {})),
        workdir=None if workdir is None else absolute_path(where, workdir, "workdir"),
        start=None if start is None else where.command(start, "start", MAX_COMMAND_BYTES),
        resources=_resources(where, top.get("resources", {})),
        ready=None if ready is None else parse_ready(where, ready),
    )


def parse_ready(where: Where, value: object, key: str = "ready") -> ReadyCheck:
    """A ``[ready]`` table (also a ready check's record from another node). Raises
    TemplateSpecError naming the key."""
    table = where.table(value, key, ("command", "http", "timeout_s"))
    if ("command" in table) == ("http" in table):
        where.fail(key, "holds exactly one of 'command' or 'http'")
    timeout_s = where.integer(
        table.get("timeout_s", DEFAULT_READY_TIMEOUT_S),
        child(key, "timeout_s"),
        1,
        MAX_READY_TIMEOUT_S,
    )
    if "command" in table:
        command = where.command(table["command"], child(key, "command"), MAX_COMMAND_BYTES)
        return ReadyCheck(command=command, timeout_s=timeout_s)
    http_key = child(key, "http")
    http = where.table(table["http"], http_key, ("port", "path"))
    for name in ("port", "path"):
        if name not in http:
            where.fail(child(http_key, name), "is required")
    port = where.integer(http["port"], child(http_key, "port"), 1, 65535)
    path = where.string(
        http["path"], child(http_key, "path"), max_bytes=1024, pattern=_HTTP_PATH_RE
    )
    return ReadyCheck(http_port=port, http_path=path, timeout_s=timeout_s)


def ready_from_record(value: object) -> ReadyCheck:
    """A ReadyCheck from its record (``dataclasses.asdict`` of one, as a node's catalog
    keeps it and another node ships it): checked as the ``[ready]`` table it came from.
    Raises TemplateSpecError."""
    where = Where(None)
    fields = where.table(value, "ready", ("command", "http_port", "http_path", "timeout_s"))
    table: dict[str, object] = {"timeout_s": fields.get("timeout_s")}
    if fields.get("command") is not None:
        table["command"] = fields["command"]
    if fields.get("http_port") is not None or fields.get("http_path") is not None:
        table["http"] = {"port": fields.get("http_port"), "path": fields.get("http_path")}
    return parse_ready(where, table)


def _env(where: Where, value: object) -> tuple[tuple[str, str], ...]:
    table = where.mapping(value, "env")
    if len(table) > MAX_ENV_ENTRIES:
        where.fail("env", f"at most {MAX_ENV_ENTRIES} entries, got {len(table)}")
    pairs = []
    for name, item in table.items():
        key = child("env", name)
        where.string(name, key, max_bytes=256, pattern=_ENV_NAME_RE)
        pairs.append((name, where.string(item, key, max_bytes=MAX_ENV_VALUE_BYTES)))
    return tuple(sorted(pairs))


def _resources(where: Where, value: object) -> Resources:
    table = where.table(value, "resources", RESOURCES)
    values = {
        name: where.integer(table[name], child("resources", name), low, high)
        for name, (low, high) in RESOURCES.items()
        if name in table
    }
    return Resources(**values)
