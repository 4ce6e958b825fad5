"""Fetch the .deb files a template's ``packages`` need, on the host, for the guest (issue 4).

Why the host fetches and the guest installs: a build VM has no network (default-deny;
egress is a later issue), so it cannot run apt itself. The node can, but the node must
never run anything from the guest's filesystem nor mount it (docs/STYLE.md, safety
habits). So the work is split at the one thing both sides can hold safely, plain files:

    host   apt-get update and install --download-only, resolved against a copy of the
           guest's /var/lib/dpkg/status (bytes read through the guest daemon), using
           the host's own apt binaries and a private configuration
    guest  dpkg -i of the .debs the builder copies in (maintainer scripts run there)

The host's apt state is never read nor changed: ``APT_CONFIG`` points apt at a private
apt.conf that moves every Dir:: (etc, sources, preferences, keyrings, lists, cache, dpkg
status and its locks, logs) under ``work_dir``, so the host's /etc/apt/apt.conf.d is
not read either. ``work_dir`` keeps package lists and .debs between calls, in one
subdirectory per (sources, arch), so lists of different sources never mix; a lock file
there serialises calls sharing it. Nothing is ever removed from it: the caller prunes.

As root, apt downloads as its ``_apt`` sandbox user when that user can reach
``work_dir``, and otherwise warns and downloads as root (apt's own fallback).

Each name means exactly the package of that name (issue 17, probe 9). A name passes
``_PACKAGE_RE`` (Debian's own rule: no ``~ ? * [ ] ^ $ | ( ) , ! ' "`` nor space), yet
apt-get, given a name that no package has, falls back on reading it otherwise: as a
regular expression (``.`` and ``+`` are legal in names: ``space-l.b``, ``space-...``
match every package alike) and, for a name ending in ``+``, as "install the package
without the ``+``". So apt is given ``name:arch`` (no trailing modifier left, and
``g++:amd64`` is still g++), and the private apt.conf sets ``APT::Cmd::Pattern-Only``
(apt 2.x: no regex or glob fallback): a name no package has exactly is "Unable to
locate package", refused naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import re
import signal
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from space.node.core.environment import child_environment
from space.node.templates.errors import TemplateError

__all__ = ["MAX_STATUS_BYTES", "PackageError", "fetch_debs"]

#: The guest's dpkg status file; a full Debian desktop's is about 10 MiB.
MAX_STATUS_BYTES = 64 << 20
_MAX_LINE_BYTES = 4096
#: More .debs than Debian main could ever pull in for one install.
_MAX_DEBS = 20_000
# How many of apt's "E:" lines an error carries: the first is the reason.
_ERROR_LINES = 5
_LOCK_POLL_S = 0.1
_READ_BYTES = 64 * 1024

# Same pattern as the spec (space/node/templates/spec.py, Debian policy 5.6.7).
_PACKAGE_RE = re.compile(r"[a-z0-9][a-z0-9+.-]{1,127}")
_ARCH_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
# apt names a fetched .deb name_version_arch.deb, "%"-quoting anything else (QuoteString).
_DEB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9+.~%_-]{0,254}\.deb")
_TREE = (
    "etc/apt.conf.d",
    "etc/sources.list.d",
    "etc/preferences.d",
    "etc/trusted.gpg.d",
    "state/lists/partial",
    "cache/archives/partial",
    "dpkg",
    "log",
    "resolve",  # stays empty: see _resolve
)
# apt-get's error for a name that no package (nor virtual package) has exactly.
_UNKNOWN_RE = re.compile(r"^E: Unable to locate package (\S+)$", re.MULTILINE)
# A --print-uris line: 'URI' FILENAME SIZE HASH
_URI_LINE_RE = re.compile(r"'[^']*' (\S+) \d+ ")
# apt.conf has no escapes: a path with these could not be written as a value; a source
# line with them (a newline above all) is not one line.
_UNQUOTABLE = re.compile(r'["\\{};\x00-\x1f\x7f]')


class PackageError(TemplateError):
    """Packages could not be fetched for a template.

    ``packages`` are the names asked for and ``detail`` apt's own error lines (at most
    five) or the tail of its output; empty when apt never ran.
    """

    def __init__(self, message: str, *, packages: Sequence[str] = (), detail: str = "") -> None:
        super().__init__(f"{message}\n{detail}" if detail else message)
        self.packages = tuple(packages)
        self.detail = detail


async def fetch_debs(
    names: Sequence[str],
    *,
    status: bytes,
    sources: Sequence[str],
    work_dir: Path,
    arch: str = "amd64",
    progress: Callable[[str], None] | None = None,
    timeout_s: float = 900,
) -> list[Path]:
    """Download the .debs that installing ``names`` into the guest needs; return their paths.

    ``status`` is the guest's /var/lib/dpkg/status (at most 64 MiB): packages installed
    there at a satisfying version are not fetched, so the list is empty when every name
    (and what it depends on) is installed. ``sources`` are one-line apt sources
    (``deb [signed-by=...] URI suite component...``), ``arch`` the guest's Debian
    architecture. Recommends are not installed. The paths are in ``work_dir``, which
    keeps lists and .debs as a cache between calls (see the module docstring).
    ``progress`` gets apt's output lines as they come, each cut at 4096 bytes.

    Raises PackageError for a malformed name (one starting with "-" included), source,
    arch or status; when apt-get is missing; when a source cannot be reached or read;
    when a package is unknown or cannot be installed (apt's message naming it); and
    when everything takes longer than ``timeout_s`` seconds. A timeout or cancellation
    kills apt-get's whole process group; ``work_dir`` is then left as apt left it,
    which the next call repairs (apt ignores partial downloads it did not finish).
    """
    _check_request(names, sources, arch, status)
    if not names:
        return []
    root = _AptRoot.for_sources(work_dir, sources, arch)
    try:
        async with asyncio.timeout(timeout_s):
            async with _locked(root.lock):
                return await _fetch(root, names, status, progress or _ignore)
    except TimeoutError:
        raise PackageError(
            f"fetching packages did not finish within {timeout_s:g} s", packages=names
        ) from None


def _check_request(names: Sequence[str], sources: Sequence[str], arch: str, status: bytes) -> None:
    for name in names:
        if name.startswith("-"):
            raise PackageError(f"package name {name!r} looks like an option", packages=names)
        if not _PACKAGE_RE.fullmatch(name) or name.endswith("-"):
            # A trailing "-" is apt-get's "remove this package".
            raise PackageError(f"invalid package name {name!r}", packages=names)
    if not sources:
        raise PackageError("no package sources given", packages=names)
    for line in sources:
        if not line.startswith("deb ") or _UNQUOTABLE.search(line):
            raise PackageError(f"invalid apt source line {line!r}", packages=names)
    if not _ARCH_RE.fullmatch(arch):
        raise PackageError(f"invalid architecture {arch!r}", packages=names)
    if len(status) > MAX_STATUS_BYTES:
        raise PackageError(
            f"dpkg status is {len(status)} bytes, more than {MAX_STATUS_BYTES}", packages=names
        )


def _ignore(line: str) -> None:
    del line


@dataclass(frozen=True, slots=True)
class _AptRoot:
    """The private apt tree of one (sources, arch) pair inside ``work_dir``."""

    path: Path
    arch: str

    @classmethod
    def for_sources(cls, work_dir: Path, sources: Sequence[str], arch: str) -> _AptRoot:
        key = hashlib.sha256("\n".join([arch, *sources]).encode()).hexdigest()[:24]
        root = cls(work_dir.resolve() / f"apt-{key}", arch)
        if _UNQUOTABLE.search(str(root.path)):
            raise PackageError(f"work directory {str(work_dir)!r} cannot be named in apt.conf")
        root.prepare(sources, arch)
        return root

    @property
    def lock(self) -> Path:
        return self.path / "lock"

    @property
    def config(self) -> Path:
        return self.path / "apt.conf"

    @property
    def archives(self) -> Path:
        return self.path / "cache" / "archives"

    @property
    def status(self) -> Path:
        # Its directory is dpkg's admin dir for apt: its lock files go there, not to
        # the host's /var/lib/dpkg.
        return self.path / "dpkg" / "status"

    def prepare(self, sources: Sequence[str], arch: str) -> None:
        """Create the tree and write its configuration (idempotent)."""
        for sub in _TREE:
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        _write(self.path / "etc" / "sources.list", "".join(f"{line}\n" for line in sources))
        _write(self.config, self._config_text(arch))

    def _config_text(self, arch: str) -> str:
        settings = {
            "Dir::Etc": f"{self.path}/etc/",
            "Dir::State": f"{self.path}/state/",
            "Dir::State::status": str(self.status),
            "Dir::Cache": f"{self.path}/cache/",
            # No binary cache of lists plus status: apt checks it by mtime in whole
            # seconds, and two statuses of one size written in one second would mix.
            "Dir::Cache::pkgcache": "",
            "Dir::Log": f"{self.path}/log/",
            "APT::Architecture": arch,
            "APT::Install-Recommends": "false",
            "APT::Install-Suggests": "false",
            "Acquire::Languages": "none",
            "Acquire::Retries": "2",
            "Acquire::Retries::Delay::Maximum": "2",
            # A name no package has is not then taken as a regex or glob (see above).
            "APT::Cmd::Pattern-Only": "true",
        }
        lines = [f'{key} "{value}";' for key, value in settings.items()]
        lines.append(f'APT::Architectures {{ "{arch}"; }};')
        return "\n".join(lines) + "\n"

    def environment(self) -> dict[str, str]:
        # APT_CONFIG is read before Dir::Etc::parts, so the host's apt.conf.d never is.
        # Never the node's environment (issue 18): apt and dpkg scripts see only this.
        return child_environment(
            APT_CONFIG=str(self.config), LC_ALL="C", DEBIAN_FRONTEND="noninteractive"
        )


def _write(path: Path, text: str) -> None:
    """Replace ``path`` atomically, so a killed call never leaves half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(text.encode())
    tmp.replace(path)


@contextlib.asynccontextmanager
async def _locked(path: Path) -> AsyncIterator[None]:
    """Hold an exclusive flock on ``path``, polling so that a timeout can interrupt."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # also releases the lock


async def _fetch(
    root: _AptRoot, names: Sequence[str], status: bytes, progress: Callable[[str], None]
) -> list[Path]:
    root.status.write_bytes(status)
    await _run_apt(
        root,
        ("update", "--error-on=any"),
        names,
        progress,
        failure="cannot update the package lists from the sources",
    )
    exact = [f"{name}:{root.arch}" for name in names]  # see the module docstring
    wanted = await _resolve(root, exact, names, progress)
    if not wanted:
        return []
    install = ("install", "--download-only", "--no-install-recommends", "-y", "--", *exact)
    await _run_apt(root, install, names, progress, failure="cannot download the packages")
    missing = [name for name in wanted if not (root.archives / name).is_file()]
    if missing:
        raise PackageError(f"apt-get did not download {', '.join(missing)}", packages=names)
    return [root.archives / name for name in wanted]


async def _resolve(
    root: _AptRoot, exact: Sequence[str], names: Sequence[str], progress: Callable[[str], None]
) -> list[str]:
    """Return the file names of every .deb the install needs, cached or not.

    --print-uris lists only what is not in the archives directory yet, so it is asked
    against an empty one: the answer is the whole set, in apt's fetch order.
    """
    argv = (
        "install",
        "--print-uris",
        "-qq",  # only the URI lines (and errors): the summary comes with the download
        "--no-install-recommends",
        "-y",
        "-o",
        f"Dir::Cache::archives={root.path}/resolve/",
        "--",
        *exact,
    )
    try:
        lines = await _run_apt(root, argv, names, progress, failure="cannot resolve the packages")
    except PackageError as exc:
        unknown = _UNKNOWN_RE.search(exc.detail)
        if unknown is None:
            raise
        name = unknown[1].removesuffix(f":{root.arch}")
        raise PackageError(
            f"no package is named exactly {name!r} in the sources (names are not patterns)",
            packages=names,
            detail=exc.detail,
        ) from None
    wanted: list[str] = []
    for line in lines:
        match = _URI_LINE_RE.match(line)
        if match is None:
            continue
        if not _DEB_NAME_RE.fullmatch(match[1]) or len(wanted) >= _MAX_DEBS:
            raise PackageError(f"unexpected apt-get download entry {line!r}", packages=names)
        wanted.append(match[1])
    return wanted


async def _run_apt(
    root: _AptRoot,
    args: Sequence[str],
    names: Sequence[str],
    progress: Callable[[str], None],
    *,
    failure: str,
) -> list[str]:
    """Run ``apt-get -q args`` in ``root``; return its output lines (--print-uris needs them).

    Raises PackageError(``failure``) with apt's "E:" lines if it exits non-zero.
    """
    output = _Output(progress)
    proc = await _spawn(("apt-get", "-q", *args), root.environment(), names)
    try:
        assert proc.stdout is not None  # piped just above
        while chunk := await proc.stdout.read(_READ_BYTES):
            output.feed(chunk)
        output.close()
        returncode = await proc.wait()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    if returncode != 0:
        raise PackageError(f"{failure} ({', '.join(names)})", packages=names, detail=output.why())
    return output.kept


async def _spawn(
    argv: Sequence[str], env: dict[str, str], names: Sequence[str]
) -> asyncio.subprocess.Process:
    try:
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    except FileNotFoundError:
        raise PackageError(
            "apt-get is not installed on this node (Debian package 'apt')", packages=names
        ) from None
    except OSError as exc:
        raise PackageError(f"cannot run apt-get: {exc}", packages=names) from exc


class _Output:
    """Split apt's output into lines of at most 4096 bytes, as they come.

    Every line goes to ``progress``; --print-uris lines are kept (bounded by _MAX_DEBS
    in the caller's check and here), "E:" lines and the last few lines for errors.
    """

    def __init__(self, progress: Callable[[str], None]) -> None:
        self._progress = progress
        self._pending = bytearray()
        self._skipping = False  # dropping the rest of an over-long line
        self.kept: list[str] = []
        self._errors: list[str] = []
        self._tail: deque[str] = deque(maxlen=_ERROR_LINES)

    def feed(self, chunk: bytes) -> None:
        self._pending += chunk
        while (end := self._pending.find(b"\n")) >= 0:
            line = bytes(self._pending[:end])
            del self._pending[: end + 1]
            if not self._skipping:
                self._line(line)
            self._skipping = False
        if len(self._pending) > _MAX_LINE_BYTES:
            if not self._skipping:
                self._line(bytes(self._pending))
            self._pending.clear()
            self._skipping = True

    def close(self) -> None:
        if self._pending and not self._skipping:
            self._line(bytes(self._pending))
        self._pending.clear()

    def why(self) -> str:
        """apt's first error lines, or its last lines when it printed none."""
        return "\n".join(self._errors or self._tail)

    def _line(self, raw: bytes) -> None:
        line = raw[:_MAX_LINE_BYTES].decode(errors="replace").rstrip("\r")
        self._progress(line)
        self._tail.append(line)
        if line.startswith("E: ") and len(self._errors) < _ERROR_LINES:
            self._errors.append(line)
        elif line.startswith("'") and len(self.kept) <= _MAX_DEBS:
            self.kept.append(line)
