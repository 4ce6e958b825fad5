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

The exec cell also finds the user's processes started by spaced's spawner helper
(issue 21: a vfork as the user, docs/security.md), within a minute of a fresh spaced.

The stdin, pty and watch cells (issue 20) feed a background ``cat`` in pieces and find
it by tag, drive a PTY session through a resize and a Ctrl-C, and watch a directory
recursively, on every origin.

The port cell (issue 20) serves a file from ``python3 -m http.server`` in the sandbox
and reads it through the platform (E2B's headers, the traffic token; the ``moving``
origins through a remote node's tunnel), then checks a missing token (401) and ports
turned off (403).

The metrics cell reads the sandbox's CPU, memory and disk as its guest reports them
(issue 20), and again once it is paused, which must not wake it.

The follow-ups ride on the same cells: the fork cell of the ``fork-child`` origin forks
a fork, the snapshot cell of ``restored`` snapshots a restored sandbox, and
``re-adopted`` is a warm-pool hit that lived through a node restart before its
hibernate cell, and ``moved-in`` was made on one node, hibernated and moved to another
by a drain (issue 19) before it was woken there; ``rehomed`` was hibernated, kept in the
artifact store and woken on the other node from there after its own node agent was
killed (then started again); ``stored-snapshot`` was made on the other node from a
snapshot the store holds while the snapshot's own node was drained.

Three platforms serve the origins: ``plain`` (no warm pool, so a create of the ready
shape is a clone of the ready state), ``pooled`` (``--warm-min 1 --warm-max 2``) and
``moving``: a `space serve` whose embedded node is drained (an embedded node's
sandboxes do not move) and two `space node` agents on loopback registered with it,
sharing one node key and one artifact store (a directory). All reach a fake internet in
a network namespace the test makes (tests/egress_world.py).

The ``gvisor-*`` origins (issue 21) are gVisor sandboxes made the way of the QEMU
origin of the same name (a create of another disk than the template's, one from the
template's gVisor ready state, one of the tenant's built template, from that
template's gVisor ready state with its start command running, a fork child, from a
snapshot, restored,
woken from hibernation, re-adopted: its runsc and channel relay lived through a
restart of `space serve`) on the ``plain`` platform, and run every cell as a VM does;
``gvisor-pool-hit`` is a hit of the warm pool of ``gvisor_pooled``, a platform whose
``auto`` guest type is gVisor (``--guest-without-kvm gvisor``); ``gvisor-moved-in``,
``gvisor-rehomed`` and ``gvisor-stored-snapshot`` go between the ``moving`` platform's
nodes as their QEMU origins do (a full stream of the volume, the guest's tree in it
kept as it was sent). Those of them whose
QEMU origin has a network have one too, and the pool hit as well: gVisor's own network
stack on a link of the sandbox's namespace, which goes through checkpoints as a VM's
NIC goes through its saved memory.
"""

from __future__ import annotations

import contextlib
import json
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from space import Sandbox
from space.node.privileged._gvisor import OVERHEAD_MIB as GVISOR_OVERHEAD_MIB
from space.node.storage.streams import subvolume_ids
from space.sdk import NotFound, PtySize, Secrets, SnapshotInfo, Template, allow

from ..egress_world import UPSTREAM, World, egress_world
from ..guest_programs import COUNTER_FILE, counter
from .platform import (
    NodeAgent,
    Platform,
    qemu_pids,
    remote_node,
    running_platform,
    shared_node_key,
)

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
    "moved-in",
    "rehomed",
    "stored-snapshot",
    *(
        f"gvisor-{kind}"
        for kind in (
            "cold-boot", "ready-state", "pool-hit", "fork-child", "from-snapshot", "restored",
            "woken", "re-adopted", "user-template", "moved-in", "rehomed", "stored-snapshot",
        )
    ),
)  # fmt: skip
#: The matrix in parts the VM lane's workers take apart (tests/conftest.py), by the
#: platform an origin needs: each part starts its own.
_PARTS = {
    "cold-boot": "plain-1", "ready-state": "plain-1", "fork-child": "plain-1",
    "from-snapshot": "plain-1", "restored": "plain-2", "woken": "plain-2",
    "user-template": "plain-2", "egress-secret": "plain-2", "pool-hit": "pooled",
    "re-adopted": "pooled", "moved-in": "moving", "rehomed": "moving",
    "stored-snapshot": "moving",
    **{origin: "gvisor" for origin in ORIGINS if origin.startswith("gvisor-")},
    "gvisor-moved-in": "moving", "gvisor-rehomed": "moving", "gvisor-stored-snapshot": "moving",
    "gvisor-user-template": "plain-2",  # the same worker builds the template once
}  # fmt: skip
#: Origins served by the platform with a warm pool (of VMs; of gVisor sandboxes).
POOLED = {"pool-hit", "re-adopted"}
GVISOR_POOLED = {"gvisor-pool-hit"}
#: Origins served by the platform whose sandboxes move between its node agents.
MOVING = {
    origin
    for kind in ("moved-in", "rehomed", "stored-snapshot")
    for origin in (kind, f"gvisor-{kind}")
}
#: Origins whose sandbox (or the sandbox it came from) has an egress policy and a
#: secret: their every cell also fetches over HTTPS with the secret swapped in. The
#: others have no policy, and every cell checks they have no network at all.
NETWORKED = {
    "egress-secret", "fork-child", "from-snapshot", "restored", "woken", "re-adopted", "moved-in",
    "rehomed", "stored-snapshot",
    *(
        f"gvisor-{kind}"
        for kind in (
            "pool-hit", "fork-child", "from-snapshot", "restored", "woken", "re-adopted",
            "moved-in", "rehomed", "stored-snapshot",
        )
    ),
}  # fmt: skip

_COUNTER = counter(0.1)
_MARKER = "/home/user/origin.txt"
_SECRET = "ghp_" + "C0nf" * 9
# The egress CA found in the guest's trust store by its subject hash (install_ca links
# it there): loading the whole bundle, as a default context does, took 0.4 s of a TCG
# guest's CPU at every check.
_FETCH = (
    "import http.client, os, ssl\n"
    "c = ssl.create_default_context(capath='/etc/ssl/certs')\n"
    "h = http.client.HTTPSConnection('tls.allowed.test', timeout=20, context=c)\n"
    "h.request('GET', '/echo', headers={'Authorization': 'Bearer ' + os.environ['API_TOKEN']})\n"
    "r = h.getresponse()\n"
    "assert r.status == 200, r.status\n"
    "print(r.read().decode())\n"
)
_WAIT_S = 60.0
_MIB = 1024 * 1024


@dataclass
class Site:
    """One platform, a key of the tenant the matrix runs as, and the data dirs of the
    platform's nodes (its embedded node's first)."""

    platform: Platform
    key: str
    node_dirs: list[Path]
    #: The site's `space node` agents by node id (to crash and restart one).
    agents: dict[str, NodeAgent] = field(default_factory=dict)

    def connect(self, sandbox_id: str) -> Sandbox:
        return Sandbox.connect(sandbox_id, api_url=self.platform.url, api_key=self.key)

    def create(self, **kw: object) -> Sandbox:
        return Sandbox.create(api_url=self.platform.url, api_key=self.key, **kw)  # type: ignore[arg-type]

    def sandbox_ids(self) -> set[str]:
        return {i.sandbox_id for i in Sandbox.list(api_url=self.platform.url, api_key=self.key)}


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


def xdist_group_of(nodeid: str) -> str:
    """The part of the matrix the test ``nodeid`` is a cell of (_PARTS: every origin
    has one; tests/conftest.py)."""
    head, _, param = nodeid.partition("[")
    return f"conformance-{_PARTS[param.removesuffix(']')]}" if param else head


# ---------------------------------------------------------------- platforms


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with egress_world() as world:
        world.records.update({"tls.allowed.test": [UPSTREAM]})
        yield world


def _egress_options(world: World) -> list[str]:
    return ["--egress-resolver", world.resolver, "--egress-upstream-ca", str(world.upstream_ca)]


def _site(data_dir: Path, world: World, *extra: str) -> Iterator[Site]:
    options = [*_egress_options(world), "--reaper-interval", "0.5", *extra]
    with running_platform(data_dir, options) as platform:
        yield _keyed(platform, [data_dir])


def _keyed(platform: Platform, node_dirs: list[Path]) -> Site:
    key = platform.create_key("conformance")
    Secrets.set("API_TOKEN", _SECRET, ["tls.allowed.test"], api_url=platform.url, api_key=key)
    return Site(platform, key, node_dirs)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, world: World) -> Iterator[Site]:
    yield from _site(tmp_path_factory.mktemp("conformance-plain"), world)


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory, world: World) -> Iterator[Site]:
    yield from _site(
        tmp_path_factory.mktemp("conformance-pooled"), world, "--warm-min", "1", "--warm-max", "2"
    )


@pytest.fixture(scope="module")
def gvisor_pooled(tmp_path_factory: pytest.TempPathFactory, world: World) -> Iterator[Site]:
    # ``auto`` is gVisor here, so its warm pool holds gVisor sandboxes (issue 21).
    yield from _site(
        tmp_path_factory.mktemp("conformance-gvisor-pooled"),
        world,
        *("--guest-without-kvm", "gvisor", "--warm-min", "1", "--warm-max", "2"),
    )


@pytest.fixture(scope="module")
def moving(tmp_path_factory: pytest.TempPathFactory, world: World) -> Iterator[Site]:
    root = tmp_path_factory.mktemp("conformance-moving")
    # One node key and one artifact store (a directory, the master key beside it) for
    # both agents, in files their user reads.
    store_key = shared_node_key(root / "artifacts")
    node_options = [
        *_egress_options(world), "--node-key-file", str(shared_node_key(root / "key")),
        "--artifact-store", f"file://{store_key.parent / 'store'}",
        "--artifact-key-file", str(store_key),
    ]  # fmt: skip
    # A node that stops heartbeating is lost within seconds (the rehomed origin).
    serve_options = [
        *_egress_options(world), "--reaper-interval", "0.5",
        "--node-heartbeat", "1", "--node-lease", "6", "--reconcile-interval", "3",
    ]  # fmt: skip
    dirs = [root / "control", root / "node-a", root / "node-b"]
    with contextlib.ExitStack() as stack:
        platform = stack.enter_context(running_platform(dirs[0], serve_options))
        agents = [stack.enter_context(remote_node(platform, d, node_options)) for d in dirs[1:]]
        site = _keyed(platform, dirs)
        site.agents = {agent.node_id: agent for agent in agents}
        (embedded,) = [n["node_id"] for n in _nodes(site) if n["url"] == "local"]
        _node_call(site, "drain", embedded)
        yield site


def _nodes(site: Site) -> list[dict[str, Any]]:
    answer = httpx.get(f"{site.platform.url}/v1/nodes", headers=_node_token(site), timeout=30)
    answer.raise_for_status()
    nodes: list[dict[str, Any]] = answer.json()["nodes"]
    return nodes


def _node_call(site: Site, action: str, node_id: str) -> None:
    """Drain or activate a node (the operator's call, with the node token)."""
    url = f"{site.platform.url}/v1/nodes/{node_id}/{action}"
    answer = httpx.post(url, headers=_node_token(site), timeout=30)
    assert answer.status_code == 200, answer.text


def _node_token(site: Site) -> dict[str, str]:
    token = (site.platform.data_dir / "node-token").read_text().strip()
    return {"Authorization": f"Bearer {token}"}


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
    if origin in GVISOR_POOLED:
        sandbox = _pool_hit(site, **network)  # ``auto``: gVisor is that platform's default
        assert sandbox.get_info().guest == "gvisor"
    elif origin == "gvisor-cold-boot":
        # Another disk than the template's: not from its gVisor ready state.
        sandbox = site.create(guest="gvisor", disk_mib=3072)
        assert sandbox.get_info().guest == "gvisor"
        assert not _from_gvisor_ready_state(site, sandbox)
    elif origin == "gvisor-user-template":
        template = request.getfixturevalue("user_template")
        sandbox = site.create(template=template, guest="gvisor")
        assert sandbox.get_info().guest == "gvisor"
        assert _from_gvisor_ready_state(site, sandbox)  # its start command ran there
        assert sandbox.files.read("/opt/app/step.txt") == "built\n"
        assert sandbox.commands.run(["test", "-s", "/tmp/alive"]).exit_code == 0
    elif origin.startswith("gvisor-"):
        # A gVisor sandbox (issue 21), restored from the template's gVisor ready state,
        # then the way of the QEMU origin of that name.
        sandbox = site.create(guest="gvisor", **network)
        assert sandbox.get_info().guest == "gvisor"
        assert _from_gvisor_ready_state(site, sandbox)
    elif origin == "cold-boot":
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
    kind = origin.removeprefix("gvisor-")

    if kind == "fork-child":
        parent, (sandbox,) = sandbox, sandbox.fork(1)
        parent.kill()
    elif kind == "from-snapshot":
        snapshot = sandbox.snapshot(f"origin-{origin}")
        sandbox.kill()
        sandbox = site.create(from_snapshot=snapshot)
        return sandbox, [snapshot.snapshot_id]
    elif kind == "restored":
        snapshot = sandbox.snapshot(f"origin-{origin}")
        sandbox.files.write(_MARKER, "written after the snapshot")
        sandbox.restore(snapshot)
        return sandbox, [snapshot.snapshot_id]
    elif kind == "woken":
        assert sandbox.hibernate().state == "hibernated"
        assert sandbox.resume().state == "running"
    elif kind == "re-adopted":
        sandbox.close()
        site.platform.stop()
        site.platform.start()
        sandbox = site.connect(sandbox.sandbox_id)
    elif kind == "moved-in":
        _move_by_drain(site, sandbox)
    elif kind == "rehomed":
        _rehome_after_crash(site, sandbox)
    elif kind == "stored-snapshot":
        return _from_stored_snapshot(site, sandbox, f"origin-{origin}")
    return sandbox, []


def _from_gvisor_ready_state(site: Site, sandbox: Sandbox) -> bool:
    """Whether the volume of ``sandbox`` is a clone of a gVisor ready state of its
    node's."""
    (record,) = _records_of(site, sandbox.sandbox_id)
    pool = record.parent.parent / "pool"
    data = json.loads(record.read_text())
    volume = pool / "sandboxes" / (data.get("volume") or sandbox.sandbox_id)
    images = (pool / "templates").glob("*/*.gvisor-ready")
    return subvolume_ids(volume).parent_uuid in {subvolume_ids(i).uuid for i in images}


def _move_by_drain(site: Site, sandbox: Sandbox) -> None:
    """Hibernate ``sandbox``, drain its node until the sandbox is on the other node,
    activate its node again and wake the sandbox where it went."""
    source = sandbox.get_info().node_id
    assert source is not None
    assert sandbox.hibernate().state == "hibernated"
    _node_call(site, "drain", source)
    try:
        _wait(lambda: sandbox.get_info().node_id != source, "the drain to move it", timeout_s=240)
    finally:
        _node_call(site, "activate", source)
    assert sandbox.get_info().state == "hibernated"
    # The row names the target before the source is told to delete its copy.
    _wait(lambda: len(_records_of(site, sandbox.sandbox_id)) == 1, "the source's copy to go")
    assert sandbox.resume().state == "running"


def _rehome_after_crash(site: Site, sandbox: Sandbox) -> None:
    """Hibernate ``sandbox`` until the artifact store holds it, kill -9 its node agent
    until the platform woke it on the other node from the store, start the agent again
    (its stale copy is deleted) and wake the sandbox where it went."""
    home = sandbox.get_info().node_id
    assert home is not None
    assert sandbox.hibernate().state == "hibernated"
    _wait(lambda: sandbox.get_info().archived, "the store to hold it", timeout_s=240)
    agent = site.agents[home]
    agent.kill()
    try:
        _wait(lambda: sandbox.get_info().node_id != home, "it to wake elsewhere", timeout_s=240)
    finally:
        agent.start()
    assert sandbox.get_info().state == "hibernated"
    _wait(lambda: len(_records_of(site, sandbox.sandbox_id)) == 1, "the stale copy to go")
    assert sandbox.resume().state == "running"


def _from_stored_snapshot(site: Site, sandbox: Sandbox, name: str) -> tuple[Sandbox, list[str]]:
    """Snapshot ``sandbox`` until the artifact store holds the snapshot, delete the
    sandbox, and make one from the snapshot while its node is drained: on the other
    node, which copies the snapshot from the store first."""
    snapshot = sandbox.snapshot(name)
    home = sandbox.get_info().node_id
    assert home is not None

    def stored() -> bool:
        listed = Sandbox.list_snapshots(api_url=site.platform.url, api_key=site.key)
        return any(s.snapshot_id == snapshot.snapshot_id and s.archived for s in listed)

    _wait(stored, "the store to hold the snapshot", timeout_s=240)
    sandbox.kill()
    _node_call(site, "drain", home)
    try:
        made = site.create(from_snapshot=snapshot)
    finally:
        _node_call(site, "activate", home)
    assert made.get_info().node_id != home
    return made, [snapshot.snapshot_id]


def _records_of(site: Site, sandbox_id: str) -> list[Path]:
    """The node records of ``sandbox_id`` on the nodes of ``site``."""
    records = [d / "sandboxes" / f"{sandbox_id}.json" for d in site.node_dirs]
    return [record for record in records if record.is_file()]


@pytest.fixture(scope="class", params=ORIGINS)
def subject(request: pytest.FixtureRequest, world: World) -> Iterator[Subject]:
    origin: str = request.param
    fixture = (
        "pooled"
        if origin in POOLED
        else "gvisor_pooled"
        if origin in GVISOR_POOLED
        else "moving"
        if origin in MOVING
        else "plain"
    )
    site: Site = request.getfixturevalue(fixture)
    before = site.sandbox_ids()
    try:
        sandbox, snapshots = _make(origin, site, request)
    except BaseException:  # what it made would fail the site's leak checks at its end
        for sandbox_id in site.sandbox_ids() - before:
            with contextlib.suppress(NotFound):
                site.connect(sandbox_id).kill()
        raise
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
        _check_no_strays(site)


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
    return int(_sh(sandbox, f"cat {COUNTER_FILE} 2>/dev/null || echo 0") or 0)


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
    _check_no_strays(subject.site)


def _check_no_strays(site: Site) -> None:
    """On every node of ``site``, every sandbox volume and QEMU belongs to a record
    that node keeps."""
    for data_dir in site.node_dirs:
        _check_node_has_no_strays(data_dir)


def _check_node_has_no_strays(data_dir: Path) -> None:
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
        # The user's processes come from spaced's spawner helper, in every origin (the
        # first execs of a sandbox whose spaced just started are spawned directly).
        deadline = time.monotonic() + _WAIT_S
        while (parent := _sh(sandbox, "cat /proc/$PPID/comm")) != "spaced-spawner":
            assert parent == "python3" and time.monotonic() < deadline, parent
            time.sleep(0.5)
        _check_whole(subject)

    def test_metrics(self, subject: Subject) -> None:
        sandbox = subject.sandbox
        _running(sandbox)
        info = sandbox.get_info()
        latest = sandbox.get_metrics()[-1]
        assert latest.cpu_count == info.cpus  # gVisor's: the spec's, not the host's it sees
        if info.guest == "gvisor":
            # gVisor shows its cgroup's memory: the guest's plus what the sandbox's
            # cgroup holds for gVisor itself (issue 21).
            limit_mib = info.memory_mib + GVISOR_OVERHEAD_MIB
            assert info.memory_mib * _MIB < latest.mem_total <= limit_mib * _MIB
        else:
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

    def test_stdin(self, subject: Subject) -> None:
        sandbox = subject.sandbox
        handle = sandbox.commands.run("cat", background=True, open_stdin=True, tag="cell-in")
        handle.send_stdin("one ")
        handle.send_stdin(b"two")
        sandbox.commands.connect(tag="cell-in").close_stdin()
        result = handle.wait(timeout_s=_WAIT_S)
        assert (result.stdout, result.exit_code) == ("one two", 0)
        _check_whole(subject)

    def test_pty(self, subject: Subject) -> None:
        sandbox, log = subject.sandbox, "/tmp/cell-pty.log"
        script = (
            f"trap 'echo GOT-INT; exit 7' INT; stty size | tee {log}; "
            f'while read l; do echo "line:$l"; stty size | tee -a {log}; done'
        )
        handle = sandbox.commands.run(["sh", "-c", script], background=True, pty=PtySize(30, 100))

        def logged(text: str) -> bool:  # by cat: a file read races the writes to it
            return text in _sh(sandbox, f"cat {log} 2>/dev/null || true")

        _wait(lambda: logged("30 100"), "the PTY's first size")
        handle.resize(PtySize(50, 132))
        handle.send_stdin("hello\n")
        _wait(lambda: logged("50 132"), "the PTY's new size")
        handle.send_stdin("\x03")  # Ctrl-C, through the guest's terminal
        result = handle.wait(timeout_s=_WAIT_S)
        assert (result.exit_code, result.stderr) == (7, "")
        assert "line:hello" in result.stdout and "GOT-INT" in result.stdout
        _check_whole(subject)

    def test_watch(self, subject: Subject) -> None:
        sandbox = subject.sandbox
        sandbox.files.make_dir("/home/user/watched/sub")
        events = sandbox.files.watch_dir("/home/user/watched", recursive=True)
        sandbox.files.write("/home/user/watched/sub/f", "x")
        seen = set()
        for event in events:
            seen.add((event.type, event.name))
            if ("create", "sub/f") in seen:
                break
        events.close()  # type: ignore[attr-defined]
        sandbox.files.remove("/home/user/watched", recursive=True)
        _check_whole(subject)

    def test_port(self, subject: Subject) -> None:
        sandbox, web = subject.sandbox, "/home/user/cell-web"
        _running(sandbox)
        sandbox.set_ports(True)
        sandbox.files.write(f"{web}/index.txt", subject.origin)
        server = sandbox.commands.run(
            f"python3 -m http.server 8081 --bind 127.0.0.1 --directory {web}",
            background=True,
            timeout_s=None,
        )
        url = f"{subject.site.platform.url}/index.txt"
        to = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8081"}
        token = {"X-Space-Traffic-Token": sandbox.traffic_token or ""}

        def served() -> bool:
            answer = httpx.get(url, headers=to | token, timeout=60)
            return answer.status_code == 200 and answer.text == subject.origin

        _wait(served, "the sandbox's web server through the platform")
        assert httpx.get(url, headers=to, timeout=60).status_code == 401
        sandbox.set_ports(False)
        assert httpx.get(url, headers=to | token, timeout=60).status_code == 403
        server.kill()
        sandbox.files.remove(web, recursive=True)
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
        sandbox, site = subject.sandbox, subject.site
        assert len(_records_of(site, sandbox.sandbox_id)) == 1  # on one node, only there
        assert sandbox.kill() is True
        assert _gone(site, sandbox.sandbox_id)
        assert _records_of(site, sandbox.sandbox_id) == []
        _check_no_strays(site)


def _gone(site: Site, sandbox_id: str) -> bool:
    try:
        site.connect(sandbox_id).close()
    except NotFound:
        return True
    return False
