"""Suite-wide rules: tests that boot VMs need root, and fail loudly instead of skipping;
a failed VM test's report carries the tails of its node's and platform's logs. And the
databases the control plane runs on (issue 19): a real PostgreSQL server for the
session (tests/postgres.py), and ``database_url``, a fresh database of each backend."""

from __future__ import annotations

import functools
import importlib
import os
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

from tests import logs
from tests.postgres import PostgresCluster
from tests.schema import migrated_sqlite

#: The control plane's database backends; ``database_url`` runs a test on each.
BACKENDS = ("sqlite", "postgresql")

#: When the test began (its setup), so only logs it may have written are shown.
_STARTED = pytest.StashKey[float]()
#: Slack for file systems whose mtimes are coarser than time.time().
_MTIME_SLACK_S = 2.0


@pytest.fixture(autouse=True)
def _vm_tests_need_root(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("vm") and os.geteuid() != 0:
        pytest.fail("this test boots QEMU VMs on a btrfs pool: run the suite as root")


@pytest.fixture(autouse=True)
def _root_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """`space serve`/`space node` run in-process (CliRunner) must not drop the test
    process's root: a server run in a subprocess does (tests/integration/platform.py)."""
    from space.node.agent import node_user

    async def keep_root(*_: object) -> None:
        return None

    monkeypatch.setattr(node_user, "become_node_user", keep_root)


@pytest.fixture(autouse=True)
def _umask_restored() -> Generator[None]:
    """A test that runs `space serve`/`space node` in-process sets umask 077 (issue 18);
    it must not change the modes every later test's files get."""
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """The VM lane's ``--dist loadgroup``, scheduled here by test file: a file is one
    group (its module fixtures, a booted VM or platform, are made once), unless the
    module splits itself with ``xdist_group_of(nodeid)`` (the conformance matrix: its
    parts run on several workers at once). xdist 3.8's own loadgroup grouped nothing under
    pytest 9.2 (seen: a marked module's tests ran on two workers), so it is not used."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class Groups(LoadScopeScheduling):  # type: ignore[misc]  # xdist has no types
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return Groups(config, log)


@functools.cache
def _module_split(path: str) -> Callable[[str], str] | None:
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    split: Callable[[str], str] | None = getattr(module, "xdist_group_of", None)
    return split


def xdist_group(nodeid: str) -> str:
    """The group of the test ``nodeid`` for the VM lane's workers (see above)."""
    path = nodeid.split("::")[0]
    split = _module_split(path) if path.endswith(".py") else None
    return split(nodeid) if split is not None else path


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = time.time() - _MTIME_SLACK_S


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Add the logs of the registered data dirs (tests/logs.py) to a failed vm test."""
    report = yield
    if report.failed and item.get_closest_marker("vm") is not None:
        since = item.stash.get(_STARTED, 0.0)
        report.sections.extend(logs.failure_sections(since))
    return report


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresCluster]:
    """A PostgreSQL server of the whole session, started on first use; stopped and its
    directory removed at the end, whatever the tests did. Fails (never skips) where
    PostgreSQL is not installed."""
    cluster = PostgresCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database of each backend in turn, at the newest schema (tests/schema.py),
    or empty for a test marked ``empty_database``: SQLite in the test's directory, then
    a new database on the session's PostgreSQL server (dropped afterwards)."""
    migrated = request.node.get_closest_marker("empty_database") is None
    if request.param == "sqlite":
        path = tmp_path / "db" / "space.db"
        if migrated:
            migrated_sqlite(path)
        yield f"sqlite:///{path}"
        return
    cluster: PostgresCluster = request.getfixturevalue("postgres")
    with cluster.database(migrated=migrated) as url:
        yield url
