"""fetch_debs against a tiny flat apt repository served on loopback.

Needs apt-get and dpkg-deb (Debian packages apt, dpkg) and dpkg-scanpackages (dpkg-dev).
No root needed: apt runs with a private tree under the test's tmp_path.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from space.node.core import environment
from space.node.templates.errors import TemplateError
from space.node.templates.packages import MAX_STATUS_BYTES, PackageError, _Output, fetch_debs
from tests.apt_repo import STATUS, served_repository

pytestmark = pytest.mark.timeout(30)

HOST_APT = (Path("/etc/apt"), Path("/var/lib/apt"), Path("/var/cache/apt"))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A one-line apt source for the test repository, served on 127.0.0.1 only."""
    with served_repository(tmp_path_factory.mktemp("apt-repo")) as line:
        yield line


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _fetch(
    names: list[str],
    source: str,
    work_dir: Path,
    *,
    progress: Callable[[str], None] | None = None,
    timeout_s: float = 20,
) -> list[Path]:
    return asyncio.run(
        fetch_debs(
            names,
            status=STATUS,
            sources=[source],
            work_dir=work_dir,
            progress=progress,
            timeout_s=timeout_s,
        )
    )


def _package_of(deb: Path) -> str:
    out = subprocess.run(["dpkg-deb", "--field", str(deb), "Package"], capture_output=True)
    return out.stdout.decode().strip()


def _snapshot(roots: tuple[Path, ...]) -> dict[str, tuple[int, int]]:
    state = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            info = path.lstat()
            state[str(path)] = (info.st_mtime_ns, info.st_size)
    return state


def test_the_dependency_is_fetched_and_the_installed_package_is_not(
    source: str, tmp_path: Path
) -> None:
    lines: list[str] = []
    debs = _fetch(["space-app"], source, tmp_path, progress=lines.append)
    assert sorted(_package_of(deb) for deb in debs) == ["space-app", "space-lib"]
    assert all(deb.is_file() and deb.is_relative_to(tmp_path) for deb in debs)
    assert any(line.startswith("Get:") and "space-lib" in line for line in lines)


def test_nothing_is_fetched_when_every_package_is_installed(source: str, tmp_path: Path) -> None:
    assert _fetch(["space-base"], source, tmp_path) == []


def test_a_second_call_returns_the_cached_debs_too(source: str, tmp_path: Path) -> None:
    first = _fetch(["space-app"], source, tmp_path)
    lines: list[str] = []
    second = _fetch(["space-lib", "space-app"], source, tmp_path, progress=lines.append)
    assert sorted(second) == sorted(first)
    assert not any("space-lib 1.0" in line and line.startswith("Get:") for line in lines)


def test_concurrent_calls_sharing_a_work_dir_both_succeed(source: str, tmp_path: Path) -> None:
    async def both() -> list[list[Path]]:
        calls = [
            fetch_debs(names, status=STATUS, sources=[source], work_dir=tmp_path)
            for names in (["space-app"], ["space-lib"])
        ]
        return list(await asyncio.gather(*calls))

    app, lib = asyncio.run(both())
    assert [_package_of(deb) for deb in lib] == ["space-lib"]
    assert set(lib) < set(app)


def test_no_names_fetch_nothing_and_touch_nothing(source: str, tmp_path: Path) -> None:
    assert _fetch([], source, tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_the_hosts_apt_state_is_not_modified(source: str, tmp_path: Path) -> None:
    before = _snapshot(HOST_APT)
    _fetch(["space-app"], source, tmp_path)
    assert _snapshot(HOST_APT) == before


def test_negative_an_unknown_package_raises_package_error_naming_it(
    source: str, tmp_path: Path
) -> None:
    with pytest.raises(PackageError) as caught:
        _fetch(["space-app", "no-such-package"], source, tmp_path)
    assert "Unable to locate package no-such-package" in str(caught.value)
    assert caught.value.packages == ("space-app", "no-such-package")
    assert isinstance(caught.value, TemplateError)


@pytest.mark.parametrize("name", ["space-...", "space-l.b", "space-lib.", "space-.+", "space-lib+"])
def test_negative_a_name_no_package_has_exactly_is_refused_not_read_as_a_pattern(
    source: str, tmp_path: Path, name: str
) -> None:
    # Each of these once downloaded space-lib (or every space-* package): apt took the
    # name as a regular expression, or a trailing "+" as "install" (issue 17, probe 9).
    with pytest.raises(PackageError) as caught:
        _fetch([name], source, tmp_path)
    message = str(caught.value).splitlines()[0]
    assert (
        message == f"no package is named exactly {name!r} in the sources (names are not patterns)"
    )
    assert caught.value.packages == (name,)
    assert list(tmp_path.rglob("*.deb")) == []


def test_names_with_plus_and_dot_that_exist_exactly_are_fetched_alone(
    source: str, tmp_path: Path
) -> None:
    # As "g++" or "libc6.1" are in Debian: legal characters, exact names.
    debs = _fetch(["space-c++", "space-lib1.0"], source, tmp_path)
    assert sorted(_package_of(deb) for deb in debs) == ["space-c++", "space-lib1.0"]


@pytest.mark.parametrize(
    "name",
    ["space-lib*", "space-?ib", "space-[a-z]ib", "^space", "space$", "a|b", "?name(space)",
     "~nspace", "space,lib", "!space", "space'", 'space"', "space lib", "space\tlib", "Space"],
)  # fmt: skip
def test_negative_apt_pattern_characters_are_refused_before_apt_runs(
    source: str, tmp_path: Path, name: str
) -> None:
    with pytest.raises(PackageError, match="invalid package name"):
        _fetch(["space-app", name], source, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_negative_an_unreachable_source_raises_package_error(tmp_path: Path) -> None:
    unreachable = f"deb [trusted=yes] http://127.0.0.1:{_closed_port()}/ ./"
    with pytest.raises(PackageError, match="cannot update the package lists") as caught:
        _fetch(["space-app"], unreachable, tmp_path)
    assert "127.0.0.1" in caught.value.detail


def test_negative_lists_of_another_source_are_never_used(source: str, tmp_path: Path) -> None:
    _fetch(["space-app"], source, tmp_path)
    unreachable = f"deb [trusted=yes] http://127.0.0.1:{_closed_port()}/ ./"
    with pytest.raises(PackageError):
        _fetch(["space-app"], unreachable, tmp_path)
    assert len(list(tmp_path.glob("apt-*"))) == 2


def test_negative_a_timeout_kills_apt_get_and_raises(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        stalled = f"deb [trusted=yes] http://127.0.0.1:{silent.getsockname()[1]}/ ./"
        with pytest.raises(PackageError, match="did not finish within 1 s"):
            _fetch(["space-app"], stalled, tmp_path, timeout_s=1)
    assert _processes_configured_under(tmp_path) == []


def _processes_configured_under(work_dir: Path) -> list[int]:
    """Pids of processes whose environment names ``work_dir`` (apt-get and its methods)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(work_dir).encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


@pytest.mark.parametrize(
    "name", ["-o", "--allow-unauthenticated", "-oAPT::Get::Trivial-Only=1", "space-app-", "A1"]
)
def test_negative_options_and_malformed_names_are_refused_before_apt_runs(
    source: str, tmp_path: Path, name: str
) -> None:
    with pytest.raises(PackageError, match=r"option|invalid package name"):
        _fetch(["space-app", name], source, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_negative_a_status_past_64_mib_is_refused(source: str, tmp_path: Path) -> None:
    status = b"x" * (MAX_STATUS_BYTES + 1)
    with pytest.raises(PackageError, match=f"more than {MAX_STATUS_BYTES}"):
        asyncio.run(fetch_debs(["space-app"], status=status, sources=[source], work_dir=tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "line",
    ["deb-src http://127.0.0.1/ ./", 'deb "http://127.0.0.1/" ./', "deb http://a/ ./\ndeb x"],
)
def test_negative_a_malformed_source_line_is_refused(tmp_path: Path, line: str) -> None:
    with pytest.raises(PackageError, match="invalid apt source line"):
        _fetch(["space-app"], line, tmp_path)


def test_negative_a_missing_apt_get_raises_package_error(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # apt-get is looked up on the children's PATH (child_environment), not this process's.
    monkeypatch.setattr(environment, "CHILD_PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(PackageError, match="apt-get is not installed"):
        _fetch(["space-app"], source, tmp_path / "work")


def test_output_lines_are_cut_at_4096_bytes_and_the_rest_dropped() -> None:
    lines: list[str] = []
    output = _Output(lines.append)
    output.feed(b"E: first\n" + b"y" * 5000)
    output.feed(b"z" * 5000 + b"\nlast")
    output.close()
    assert lines == ["E: first", "y" * 4096, "last"]
    assert output.why() == "E: first"
