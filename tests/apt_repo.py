"""A tiny flat apt repository for template package tests, served on 127.0.0.1 only.

space-app depends on space-lib and space-base; STATUS is a dpkg status in which
space-base is installed. Each package installs ``/usr/share/<name>/installed``.
Needs dpkg-deb (dpkg), dpkg-scanpackages (dpkg-dev) and apt-get (apt).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import lzma
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PACKAGES", "STATUS", "served_directory", "served_repository"]

PACKAGES = {
    "space-lib": ("1.0", ""),
    "space-base": ("1.0", ""),
    "space-app": ("1:2.0", "space-lib, space-base"),
    # Names with "+" and ".", legal in Debian (g++, libc6.1) and apt regex characters.
    "space-c++": ("1.0", ""),
    "space-lib1.0": ("1.0", ""),
}
STATUS = b"""Package: space-base
Status: install ok installed
Version: 1.0
Architecture: all
Maintainer: SPACE tests <tests@example.org>
Description: installed in the guest

"""


def _build_deb(src: Path, out: Path, name: str, version: str, depends: str) -> None:
    control = src / name / "DEBIAN" / "control"
    control.parent.mkdir(parents=True)
    fields = [
        f"Package: {name}",
        f"Version: {version}",
        "Architecture: all",
        "Maintainer: SPACE tests <tests@example.org>",
        f"Description: test package {name}",
    ]
    control.write_text("\n".join(fields + ([f"Depends: {depends}"] if depends else [])) + "\n")
    payload = src / name / "usr" / "share" / name / "installed"
    payload.parent.mkdir(parents=True)
    payload.write_text(f"{name} {version}\n")
    deb = out / f"{name}_{version}_all.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "--build", str(src / name), str(deb)],
        check=True,
        capture_output=True,
    )


def _make_repository(root: Path) -> Path:
    for tool in ("dpkg-deb", "dpkg-scanpackages", "apt-get"):
        assert shutil.which(tool), f"{tool} is missing (Debian packages dpkg, dpkg-dev, apt)"
    repo = root / "repo"
    repo.mkdir(parents=True)
    for name, (version, depends) in PACKAGES.items():
        _build_deb(root / "src", repo, name, version, depends)
    index = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", ".", "/dev/null"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout
    (repo / "Packages").write_bytes(index)
    # apt asks for Packages.xz first: serving it spares a round of 404s.
    (repo / "Packages.xz").write_bytes(lzma.compress(index))
    return repo


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        del format, args


@contextlib.contextmanager
def served_repository(root: Path) -> Iterator[str]:
    """Build the repository under ``root`` and serve it; yields its one-line apt source."""
    with served_directory(_make_repository(root)) as source:
        yield source


@contextlib.contextmanager
def served_directory(repo: Path) -> Iterator[str]:
    """Serve ``repo`` (a flat repository: .debs beside a Packages index) on 127.0.0.1;
    yields its one-line apt source."""
    handler = functools.partial(_QuietHandler, directory=str(repo))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"deb [trusted=yes] http://127.0.0.1:{server.server_address[1]}/ ./"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
