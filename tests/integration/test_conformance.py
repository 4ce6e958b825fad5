"""The conformance matrix (issue 12): every way a sandbox comes to exist, crossed with
every operation, on real VMs through the whole stack (SDK -> REST -> control plane ->
node -> QEMU -> spaced).

Each origin is one parametrisation of ``TestEveryOperation``; each operation is one of
its test methods, so a failing cell is named ``test_<operation>[<origin>]``. The
methods of a class share one sandbox and run in the order written: a cell first brings
the sandbox back to running if an earlier cell left it otherwise, and every cell ends by
checking the sandbox is whole (``_check_whole``): it runs, the file and the background
process its origin started are there, its network and secret still work where it has
them, and the node holds no volume or VM that no record names.

The metrics cell reads the sandbox's CPU, memory and disk as its guest reports them
(issue 20), and again once it is paused, which must not wake it.

The follow-ups ride on the same cells: the fork cell of the ``fork-child`` origin forks
a fork, the snapshot cell of ``restored`` snapshots a restored sandbox, and
``re-adopted`` is a warm-pool hit that lived through a node restart before its
hibernate cell.

Two platforms serve the origins: ``plain`` (no warm pool, so a create of the ready shape
is a clone of the ready state) and ``pooled`` (``--warm-min 1 --warm-max 2``). Both
reach a fake internet in a network namespace the test makes (tests/egress_world.py).
"""

from __future__ import annotations

import contextlib
import json
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from space import Sandbox
from space.sdk import NotFound, Secrets, SnapshotInfo, Template, allow

from ..egress_world import UPSTREAM, World, egress_world
from .platform import Platform, qemu_pids, running_platform

pytestmark = pytest.mark.vm

ORIGINS = (
    "cold-boot",
    "ready-state",
    "pool-hit",
    "fork-child",
    "from-snapshot",
    "restored",
    "woken",
    "re-adopted",
    "user-template",
    "egress-secret",
)
#: Origins served by the platform with a warm pool.
POOLED = {"pool-hit", "re-adopted"}
#: Origins whose sandbox (or the sandbox it came from) has an egress policy and a
#: secret: their every cell also fetches over HTTPS with the secret swapped in. The
#: others have no policy, and every cell checks they have no network at all.
NETWORKED = {"egress-secret", "fork-child", "from-snapshot", "restored", "woken", "re-adopted"}

_COUNTER = (
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; mv -f /tmp/c.new /tmp/c; sleep 0.1; done"
)
_MARKER = "/home/user/origin.txt"
_SECRET = "ghp_" + "C0nf" * 9
_FETCH = (
    "import os, urllib.request as u\n"
    "r = u.Request('https://tls.allowed.test/echo',"
    " headers={'Authorization': 'Bearer ' + os.environ['API_TOKEN']})\n"
    "print(u.urlopen(r, timeout=20).read().decode())\n"
)
_WAIT_S = 60.0
_MIB = 1024 * 1024


@dataclass
class Site:
    """One platform and a key of the tenant the matrix runs as."""

    platform: Platform
    key: str

    def connect(self, sandbox_id: str) -> Sandbox:
        return Sandbox.connect(sandbox_id, api_url=self.platform.url, api_key=self.key)

    def create(self, **kw: object) -> Sandbox:
        return Sandbox.create(api_url=self.platform.url, api_key=self.key, **kw)  # type: ignore[arg-type]


@dataclass
class Subject:
    """The sandbox under test and what its cells carry from one to the next."""

    origin: str
    site: Site
    sandbox: Sandbox
    world: World
    networked: bool = False
    snapshot: SnapshotInfo | None = None
    child: Sandbox | None = None
    snapshots: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- platforms


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with egress_world() as world:
        world.records.update({"tls.allowed.test": [UPSTREAM]})
        yield world


def _site(data_dir: Path, world: World, *extra: str) -> Iterator[Site]:
    options = [
        "--egress-resolver", world.resolver,
        "--egress-upstream-ca", str(world.upstream_ca),
        "--reaper-interval", "0.5",
        *extra,
    ]  # fmt: skip
    with running_platform(data_dir, options) as platform:
        key = platform.create_key("conformance")
        Secrets.set("API_TOKEN", _SECRET, ["tls.allowed.test"], api_url=platform.url, api_key=key)
        yield Site(platform, key)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, world: World) -> Iterator[Site]:
    yield from _site(tmp_path_factory.mktemp("conformance-plain"), world)


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory, world: World) -> Iterator[Site]:
    yield from _site(
        tmp_path_factory.mktemp("conformance-pooled"), world, "--warm-min", "1", "--warm-max", "2"
    )


@pytest.fixture(scope="module")
def user_template(plain: Site, tmp_path_factory: pytest.TempPathFactory) -> str:
    context = tmp_path_factory.mktemp("conformance-template")
    (context / "app").mkdir()
    (context / "app" / "data.txt").write_text("from the template\n")
    (context / "space.toml").write_text(
        textwrap.dedent("""\
        name = "conformance"
        tag = "v1"
        base = "debian:bookworm"
        start = "sh -c 'while true; do date +%s > /tmp/alive; sleep 1; done'"

        [[steps]]
        copy = { src = "app", dst = "/opt/app" }

        [[steps]]
        run = "echo built > /opt/app/step.txt"
        """)
    )
    info = Template.build(context, api_url=plain.platform.url, api_key=plain.key)
    return f"{info.name}:v1"


# ---------------------------------------------------------------- origins


def _mark(sandbox: Sandbox, origin: str) -> None:
    """Leave a file and a background process for every later cell to find."""
    sandbox.files.write(_MARKER, origin)
    sandbox.commands.run(_COUNTER, background=True, timeout_s=None)
    _wait(lambda: _counter(sandbox) > 0, "the counter to start")


def _pool_hits(site: Site) -> int:
    pools = Sandbox.list_pools(api_url=site.platform.url, api_key=site.key)
    return sum(p.hits for p in pools if p.template.startswith("base"))


def _pool_hit(site: Site, **kw: object) -> Sandbox:
    def filled() -> bool:
        pools = Sandbox.list_pools(api_url=site.platform.url, api_key=site.key)
        return any(p.size > 0 for p in pools if p.template.startswith("base"))

    _wait(filled, "the warm pool to fill", timeout_s=240)
    hits = _pool_hits(site)
    sandbox = site.create(**kw)
    assert _pool_hits(site) == hits + 1, "the create was not served by the warm pool"
    return sandbox


def _make(origin: str, site: Site, request: pytest.FixtureRequest) -> tuple[Sandbox, list[str]]:
    """A sandbox that came to exist by ``origin``, marked; and snapshots made on the way."""
    network: dict[str, object] = {}
    if origin in NETWORKED:
        network = {"egress": allow("tls.allowed.test:443"), "secrets": ["API_TOKEN"]}
    if origin == "cold-boot":
        # The ready state has the default 2048 MiB disk: another size boots.
        sandbox = site.create(disk_mib=3072)
    elif origin in POOLED:
        sandbox = _pool_hit(site, **network)
    elif origin == "user-template":
        sandbox = site.create(template=request.getfixturevalue("user_template"))
        assert sandbox.files.read("/opt/app/step.txt") == "built\n"
    else:
        sandbox = site.create(**network)
    _mark(sandbox, origin)

    if origin == "fork-child":
        parent, (sandbox,) = sandbox, sandbox.fork(1)
        parent.kill()
    elif origin == "from-snapshot":
        snapshot = sandbox.snapshot(f"origin-{origin}")
        sandbox.kill()
        sandbox = site.create(from_snapshot=snapshot)
        return sandbox, [snapshot.snapshot_id]
    elif origin == "restored":
        snapshot = sandbox.snapshot(f"origin-{origin}")
        sandbox.files.write(_MARKER, "written after the snapshot")
        sandbox.restore(snapshot)
        return sandbox, [snapshot.snapshot_id]
    elif origin == "woken":
        assert sandbox.hibernate().state == "hibernated"
        assert sandbox.resume().state == "running"
    elif origin == "re-adopted":
        sandbox.close()
        site.platform.stop()
        site.platform.start()
        sandbox = site.connect(sandbox.sandbox_id)
    return sandbox, []


@pytest.fixture(scope="class", params=ORIGINS)
def subject(request: pytest.FixtureRequest, world: World) -> Iterator[Subject]:
    origin: str = request.param
    site: Site = request.getfixturevalue("pooled" if origin in POOLED else "plain")
    sandbox, snapshots = _make(origin, site, request)
    subject = Subject(origin, site, sandbox, world, networked=origin in NETWORKED)
    subject.snapshots += snapshots
    try:
        _check_whole(subject)
        yield subject
    finally:
        for leftover in (subject.child, subject.sandbox):
            if leftover is not None:
                with contextlib.suppress(NotFound):
                    site.connect(leftover.sandbox_id).kill()
        for snapshot_id in subject.snapshots:
            Sandbox.delete_snapshot(snapshot_id, api_url=site.platform.url, api_key=site.key)
        _check_no_strays(site.platform)


# ---------------------------------------------------------------- checks


def _wait(predicate: Callable[[], bool], what: str, *, timeout_s: float = _WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _sh(sandbox: Sandbox, cmd: str) -> str:
    result = sandbox.commands.run(cmd)
    assert result.exit_code == 0, (cmd, result)
    return result.stdout.strip()


def _counter(sandbox: Sandbox) -> int:
    return int(_sh(sandbox, "cat /tmp/c 2>/dev/null || echo 0") or 0)


def _running(sandbox: Sandbox) -> None:
    if sandbox.get_info().state != "running":
        assert sandbox.resume().state == "running"


def _check_whole(subject: Subject, sandbox: Sandbox | None = None) -> None:
    """The sandbox runs with its origin's file, process, network and secret, and the
    node holds nothing no record names."""
    sandbox = sandbox or subject.sandbox
    assert sandbox.get_info().state == "running"
    assert sandbox.files.read(_MARKER) == subject.origin
    before = _counter(sandbox)
    _wait(lambda: _counter(sandbox) > before, "the background counter to go on")
    if subject.networked:
        env = _sh(sandbox, "env")
        assert "API_TOKEN=space_ph_" in env and _SECRET not in env
        fetched = sandbox.commands.run(["python3", "-c", _FETCH])
        assert fetched.exit_code == 0, fetched.stderr
        assert _SECRET in subject.world.hits_of("tls")[-1].data.decode()
    else:
        assert sandbox.commands.run(["getent", "hosts", "tls.allowed.test"]).exit_code != 0
    _check_no_strays(subject.site.platform)


def _check_no_strays(platform: Platform) -> None:
    """Every sandbox volume and QEMU on the node belongs to a record the node keeps."""
    data_dir = platform.data_dir
    records = [json.loads(p.read_text()) for p in (data_dir / "sandboxes").glob("*.json")]
    volumes = {r.get("volume") or r["spec"]["sandbox_id"] for r in records}
    run_dirs = {Path(r["run_dir"]).name for r in records}
    on_disk = {p.name for p in (data_dir / "pool" / "sandboxes").iterdir()}
    assert on_disk <= volumes, f"volumes no record names: {on_disk - volumes}"
    for pid in qemu_pids(data_dir):
        with contextlib.suppress(FileNotFoundError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            assert any(f"/{name}/agent.sock" in argv for name in run_dirs), f"stray qemu {pid}"


# ---------------------------------------------------------------- the matrix


class TestEveryOperation:
    def test_exec(self, subject: Subject) -> None:
        sandbox = subject.sandbox
        result = sandbox.commands.run("echo out; echo err >&2; exit 3")
        assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 3)
        argv = sandbox.commands.run(["python3", "-c", "import sys; print(sys.argv[1])", "a b"])
        assert argv.stdout == "a b\n"
        assert _sh(sandbox, "hostname") == sandbox.sandbox_id
        _check_whole(subject)

    def test_metrics(self, subject: Subject) -> None:
        sandbox = subject.sandbox
        _running(sandbox)
        info = sandbox.get_info()
        latest = sandbox.get_metrics()[-1]
        assert latest.cpu_count == info.cpus
        # The guest kernel keeps part of its RAM to itself: MemTotal is a little less.
        assert 0.75 * info.memory_mib * _MIB < latest.mem_total <= info.memory_mib * _MIB
        assert 0 < latest.mem_used < latest.mem_total
        assert 0 < latest.disk_used < latest.disk_total
        assert sandbox.pause().state == "paused"
        assert sandbox.get_metrics()[-1] == latest  # what the node kept: not woken for it
        assert sandbox.get_info().state == "paused"
        assert sandbox.resume().state == "running"
        _check_whole(subject)

    def test_files(self, subject: Subject) -> None:
        sandbox, data = subject.sandbox, bytes(range(256)) * 4096  # 1 MiB
        sandbox.files.write("/home/user/cell/blob", data)
        assert sandbox.files.read("/home/user/cell/blob", format="bytes") == data
        assert sandbox.files.stat("/home/user/cell/blob").size == len(data)
        sandbox.files.rename("/home/user/cell/blob", "/home/user/cell/moved")
        assert [f.name for f in sandbox.files.list("/home/user/cell")] == ["moved"]
        sandbox.files.remove("/home/user/cell", recursive=True)
        assert not sandbox.files.exists("/home/user/cell")
        _check_whole(subject)

    def test_pause_resume(self, subject: Subject) -> None:
        sandbox = subject.sandbox
        _running(sandbox)
        assert sandbox.pause().state == "paused"
        assert sandbox.get_info().state == "paused"
        assert sandbox.resume().state == "running"
        _check_whole(subject)

    def test_hibernate_wake(self, subject: Subject) -> None:
        sandbox = subject.sandbox
        _running(sandbox)
        sandbox.files.write("/home/user/before-hibernate", "kept")
        before = _counter(sandbox)
        assert sandbox.hibernate().state == "hibernated"
        assert sandbox.get_info().state == "hibernated"
        assert sandbox.resume().state == "running"
        assert sandbox.files.read("/home/user/before-hibernate") == "kept"
        assert _counter(sandbox) >= before  # the same process, carrying on
        _check_whole(subject)

    def test_snapshot(self, subject: Subject) -> None:
        sandbox = subject.sandbox
        _running(sandbox)
        sandbox.files.write("/home/user/era", "snapshot")
        snapshot = sandbox.snapshot(f"cell-{subject.origin}")
        subject.snapshot = snapshot
        subject.snapshots.append(snapshot.snapshot_id)
        assert snapshot.snapshot_id in {s.snapshot_id for s in sandbox.snapshots()}
        assert sandbox.get_info().head_snapshot == snapshot.snapshot_id
        assert sandbox.get_info().state == "running"
        _check_whole(subject)

    def test_restore(self, subject: Subject) -> None:
        sandbox = subject.sandbox
        assert subject.snapshot is not None, "the snapshot cell failed"
        _running(sandbox)
        sandbox.files.write("/home/user/era", "after the snapshot")
        assert sandbox.restore(subject.snapshot).state == "running"
        assert sandbox.files.read("/home/user/era") == "snapshot"
        _check_whole(subject)

    def test_fork(self, subject: Subject) -> None:
        sandbox = subject.sandbox
        _running(sandbox)
        (child,) = sandbox.fork(1)
        subject.child = child
        assert child.files.read("/home/user/era") == "snapshot"
        assert _sh(child, "cat /etc/machine-id") != _sh(sandbox, "cat /etc/machine-id")
        child.files.write("/home/user/child-only", "child")
        assert not sandbox.files.exists("/home/user/child-only")
        _check_whole(subject, child)
        _check_whole(subject)

    def test_timeouts(self, subject: Subject) -> None:
        sandbox = subject.sandbox
        _running(sandbox)
        sandbox.set_timeouts(idle_timeout_s=1)
        _wait(lambda: sandbox.get_info().state == "hibernated", "the idle sandbox to hibernate")
        sandbox.set_timeouts(idle_timeout_s=None)
        assert sandbox.files.read(_MARKER) == subject.origin  # activity wakes it
        assert sandbox.get_info().state == "running"
        if subject.child is not None:  # the fork cell's child: its lifetime ends it
            child = subject.child
            child.set_timeouts(max_lifetime_s=1)
            _wait(lambda: _gone(subject.site, child.sandbox_id), "the expired child to go")
            child.close()
            subject.child = None
        _check_whole(subject)

    def test_delete(self, subject: Subject) -> None:
        sandbox, platform = subject.sandbox, subject.site.platform
        record = platform.data_dir / "sandboxes" / f"{sandbox.sandbox_id}.json"
        assert record.is_file()
        assert sandbox.kill() is True
        assert _gone(subject.site, sandbox.sandbox_id)
        assert not record.exists()
        _check_no_strays(platform)


def _gone(site: Site, sandbox_id: str) -> bool:
    try:
        site.connect(sandbox_id).close()
    except NotFound:
        return True
    return False
