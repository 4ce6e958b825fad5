"""Suite-wide rules: tests that boot VMs need root, and fail loudly instead of skipping;
a failed VM test's report carries the tails of its node's and platform's logs. And the
databases the control plane runs on (issue 19): a real PostgreSQL server for the
session (tests/postgres.py), and ``database_url``, a fresh database of each backend."""

from __future__ import annotations

import functools
import importlib
import json
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


#: Seconds each VM-lane group took in a recent run (``--record-group-seconds``), so the
#: longest are handed out first: in collection order, a file of one long test (a hundred
#: lifecycle cycles) could start last and hold a worker while the others idled.
GROUP_SECONDS = Path(__file__).with_name("vm_lane_seconds.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-group-seconds",
        metavar="PATH",
        help="write the seconds each xdist group took (setup, call, teardown) to PATH as "
        "JSON; tests/vm_lane_seconds.json is such a file, of the VM lane",
    )


def pytest_configure(config: pytest.Config) -> None:
    out = config.getoption("record_group_seconds")
    if out and not hasattr(config, "workerinput"):  # the controller sees every report
        config.pluginmanager.register(GroupSeconds(Path(out)), "space-group-seconds")


class GroupSeconds:
    """Sums each group's test durations as reports arrive; writes them at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seconds: dict[str, float] = {}
        self.tests: dict[str, set[str]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        group = xdist_group(report.nodeid)
        self.seconds[group] = self.seconds.get(group, 0.0) + report.duration
        self.tests.setdefault(group, set()).add(report.nodeid)

    def pytest_sessionfinish(self) -> None:
        ranked = sorted(self.seconds, key=lambda group: -self.seconds[group])
        table = {g: {"s": round(self.seconds[g], 1), "tests": len(self.tests[g])} for g in ranked}
        self.out.write_text(json.dumps(table, indent=1) + "\n")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """The VM lane's ``--dist loadgroup``, scheduled here by test file: a file is one
    group (its module fixtures, a booted VM or platform, are made once), unless the
    module splits itself with ``xdist_group_of(nodeid)`` (the conformance matrix: its
    parts run on several workers at once). xdist 3.8's own loadgroup grouped nothing under
    pytest 9.2 (seen: a marked module's tests ran on two workers), so it is not used.
    Groups go out longest first (GROUP_SECONDS; one it lacks is guessed from its count of
    tests), which keeps the lane's end from waiting on one long file."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    known: dict[str, dict[str, float]] = json.loads(GROUP_SECONDS.read_text())
    seconds = {group: row["s"] for group, row in known.items()}
    tests = sum(row["tests"] for row in known.values())
    per_test = sum(seconds.values()) / tests if tests else 1.0

    class Groups(LoadScopeScheduling):  # type: ignore[misc]  # xdist has no types
        ranked = False

        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

        def _assign_work_unit(self, node: object) -> None:
            # schedule() fills the whole queue before its first assignment.
            if not self.ranked:
                units = sorted(
                    self.workqueue.items(),
                    key=lambda unit: -seconds.get(unit[0], per_test * len(unit[1])),
                )
                self.workqueue.clear()
                self.workqueue.update(units)
                self.ranked = True
            super()._assign_work_unit(node)

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
