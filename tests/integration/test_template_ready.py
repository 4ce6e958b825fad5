"""A template's ``[ready]`` check and the node's build cache, on real nodes.

Small templates on ``base``: the ready-check builds have no disk step (no build VM,
one ready-state boot each); the build cache's builds have one run step. The heavy
code-interpreter test (test_e2b_code_interpreter.py) uses both at scale; these are
their cheap checks in the default suite.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from space.node.agent import Node
from space.node.api import BuildFailed, NotFound, SandboxSpec, SandboxState, Unavailable
from space.node.core.config import NodeConfig

from .. import logs
from .conftest import NodeHarness, release_data_dir, started_node
from .test_lifecycle import _sh
from .test_templates import _build, _built, _context, _logs, _removing_templates

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def build_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("build-cache")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # layers' streams: large


@pytest.fixture(scope="module")
def node(node_config: NodeConfig, build_cache: Path) -> Iterator[NodeHarness]:
    """One node for this module's tests (each deletes its templates), with a build
    cache: node A of the build cache's test."""
    with started_node(replace(node_config, build_cache_dir=build_cache)) as harness:
        yield harness


@pytest.fixture
def templates(node: NodeHarness) -> Iterator[NodeHarness]:
    with _removing_templates(node) as harness:
        yield harness


def _ready_spec(name: str, start: str, ready: str) -> str:
    return textwrap.dedent(f"""\
        name = "{name}"
        base = "debian:bookworm"
        start = "{start}"

        [ready]
        """) + textwrap.dedent(ready)


#: Makes its mark only after a while: a ready state saved without waiting for the
#: check (after the start command's 1 s grace) would not have it, nor would a sandbox
#: exec'd at once.
_LATE_MARK = "sh -c 'sleep 8; touch /tmp/ready-mark; exec sleep infinity'"


def test_a_command_check_holds_the_ready_state_until_it_passes(
    templates: NodeHarness, tmp_path: Path
) -> None:
    ready = 'command = "test -f /tmp/ready-mark"\ntimeout_s = 120\n'
    spec = _ready_spec("ready-cmd", _LATE_MARK, ready)
    info = _built(templates.run(_build(templates.node, _context(tmp_path, spec))))
    assert info.ready
    status = templates.run(templates.node.create_sandbox(SandboxSpec("rc", template="ready-cmd")))
    assert status.state == SandboxState.RUNNING
    assert _sh(templates, "rc", "test -f /tmp/ready-mark && echo marked") == "marked"


def test_an_http_check_holds_the_ready_state_until_the_server_answers(
    templates: NodeHarness, tmp_path: Path
) -> None:
    start = (
        "sh -c 'sleep 8; mkdir -p /tmp/www; echo healthy > /tmp/www/health;"
        " exec python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp/www'"
    )
    ready = 'http = { port = 8000, path = "/health" }\ntimeout_s = 120\n'
    info = _built(
        templates.run(
            _build(templates.node, _context(tmp_path, _ready_spec("ready-http", start, ready)))
        )
    )
    assert info.ready
    templates.run(templates.node.create_sandbox(SandboxSpec("rh", template="ready-http")))
    url = "http://127.0.0.1:8000/health"
    get = f"python3 -c \"import urllib.request as u; print(u.urlopen('{url}').read().decode())\""
    assert _sh(templates, "rh", get) == "healthy"


def test_a_check_that_never_passes_fails_the_build_and_publishes_nothing(
    templates: NodeHarness, tmp_path: Path
) -> None:
    ready = 'command = "test -f /tmp/never-made"\ntimeout_s = 3\n'
    spec = _ready_spec("ready-never", "sleep infinity", ready)
    events = templates.run(_build(templates.node, _context(tmp_path, spec)))
    outcome = events[-1]
    assert isinstance(outcome, BuildFailed), outcome
    assert outcome.code == "unavailable", outcome
    assert "the ready check test -f /tmp/never-made (within 3 s) did not pass" in outcome.message
    assert "exit code 1" in outcome.message
    assert "ready-never" not in {t.name for t in templates.run(templates.node.list_templates())}
    with pytest.raises(NotFound):
        templates.run(templates.node.create_sandbox(SandboxSpec("rn", template="ready-never")))
    pool = templates.node.pool.root
    assert not (pool / "templates" / "ready-never").exists()
    assert not any("ready-" in p.name for p in (pool / "sandboxes").iterdir())


#: Passes in a VM (a user may not read the kernel's log there, so nothing matches),
#: never under gVisor (whose log says gVisor).
_NOT_IN_GVISOR = 'command = "! dmesg 2>/dev/null | grep -q gVisor"\ntimeout_s = 3\n'


def test_a_check_that_fails_under_gvisor_only_leaves_the_build_its_vm_ready_state(
    templates: NodeHarness, tmp_path: Path
) -> None:
    """The gVisor ready state is the node's extra: its failure is logged and
    remembered beside the build (a node's later starts do not wait for it again), the
    build and its VM ready state stand, and a gVisor sandbox of the template boots and
    runs the check at create, failing as the check does."""
    spec = _ready_spec("ready-vm-only", "sleep infinity", _NOT_IN_GVISOR)
    info = _built(templates.run(_build(templates.node, _context(tmp_path, spec))))
    assert info.ready
    template = templates.node.templates.catalog.resolve("ready-vm-only")
    assert template.ready is not None and template.gvisor_ready is None
    assert "did not pass" in template.gvisor_ready_failed.read_text()
    assert not template.gvisor_ready_image.exists()
    sandboxes = templates.node.pool.root / "sandboxes"
    assert not any("ready-" in p.name for p in sandboxes.iterdir())

    templates.restart()
    again = templates.node.templates.catalog.resolve("ready-vm-only")
    assert again.gvisor_ready is None and again.gvisor_ready_failed.is_file()
    assert not any("ready-" in p.name for p in sandboxes.iterdir())  # not tried again
    vm = templates.run(templates.node.create_sandbox(SandboxSpec("vo", template="ready-vm-only")))
    assert vm.state == SandboxState.RUNNING
    with pytest.raises(Unavailable, match="did not pass"):
        templates.run(
            templates.node.create_sandbox(
                SandboxSpec("vo-gv", template="ready-vm-only", guest="gvisor")
            )
        )
    templates.run(templates.node.delete_sandbox("vo"))
    templates.run(templates.node.delete_template("ready-vm-only"))
    assert not template.gvisor_ready_failed.exists()


@contextlib.contextmanager
def _second_node(first: NodeHarness, config: NodeConfig) -> Iterator[NodeHarness]:
    """A node on ``config`` on ``first``'s event loop (two nodes of one process, as in
    moves_nodes.py); on exit it shuts down and nothing of its data dir may be left."""
    logs.register(config.data_dir, config.effective_run_dir)
    try:
        harness = NodeHarness(config, first.runner, first.run(Node.start(config)))
        try:
            yield harness
        finally:
            harness.run(harness.node.shutdown(unmount_pool=True))
    finally:
        leaked = release_data_dir(config.data_dir)
        assert not leaked, f"left behind by node B: {leaked}"


def _stamp_spec(name: str) -> str:
    # The run step's output is new on every run: a sandbox's stamp says which build
    # made its layer.
    return textwrap.dedent(f"""\
        name = "{name}"
        base = "debian:bookworm"

        [[steps]]
        run = "head -c 16 /dev/urandom | base64 > /opt/stamp"
        """)


def _stamp(h: NodeHarness, template: str, sandbox_id: str) -> str:
    h.run(h.node.create_sandbox(SandboxSpec(sandbox_id, template=template)))
    stamp = _sh(h, sandbox_id, "cat /opt/stamp")
    assert len(stamp) == 24, stamp
    return stamp


def _entries(directory: Path) -> set[str]:
    return {path.stem for path in directory.glob("*.json")}


def test_a_fresh_node_receives_a_cached_layer_and_refuses_a_damaged_one(
    templates: NodeHarness, build_cache: Path, tmp_path: Path
) -> None:
    a = templates
    for context in ("good", "bad"):
        (tmp_path / context).mkdir()
    # Node A builds both templates; each build's last layer goes to the cache.
    before = _entries(build_cache)
    events = a.run(_build(a.node, _context(tmp_path / "good", _stamp_spec("cached-good"))))
    _built(events)
    assert any(line.startswith("kept layer ") for line in _logs(events)), _logs(events)
    (good,) = _entries(build_cache) - before
    events = a.run(_build(a.node, _context(tmp_path / "bad", _stamp_spec("cached-bad"))))
    _built(events)
    (bad,) = _entries(build_cache) - before - {good}
    stamp_good, stamp_bad = _stamp(a, "cached-good", "a-good"), _stamp(a, "cached-bad", "a-bad")
    # A byte of the second's stream flipped: its record's SHA-256 no longer matches.
    stream = build_cache / f"{bad}.stream"
    with stream.open("r+b") as file:
        file.seek(stream.stat().st_size // 2)
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0xFF]))

    # Node B: a fresh data dir and pool, A's node key and cache.
    config = NodeConfig(
        data_dir=tmp_path / "node-b",
        pool_size_gib=8,
        boot_timeout_s=90.0,
        key_file=a.config.effective_key_file,
        build_cache_dir=build_cache,
    )
    config.data_dir.mkdir()
    with _second_node(a, config) as b:
        events = b.run(_build(b.node, _context(tmp_path / "good", _stamp_spec("cached-good"))))
        _built(events)
        logs_good = _logs(events)
        assert any("from the build cache" in line for line in logs_good), logs_good
        assert any(
            line.startswith("step 1/2 run") and line.endswith("(cached)") for line in logs_good
        )
        assert not any(line.startswith("booting a build VM") for line in logs_good), logs_good
        assert _stamp(b, "cached-good", "b-good") == stamp_good  # A's layer, not a new run

        events = b.run(_build(b.node, _context(tmp_path / "bad", _stamp_spec("cached-bad"))))
        _built(events)
        logs_bad = _logs(events)
        assert any("is refused" in line for line in logs_bad), logs_bad
        assert any(line.startswith("step 1/2 run") and "(cached)" not in line for line in logs_bad)
        assert _stamp(b, "cached-bad", "b-bad") != stamp_bad  # the step ran again
        incoming = b.node.pool.root / "incoming"
        assert not incoming.exists() or not any(incoming.iterdir())  # nothing half-received
        # The damaged entry was replaced by this build's layer: it checks out again.
        record = json.loads((build_cache / f"{bad}.json").read_text())
        assert record["sha256"] == _sha256(stream), record
        b.run(b.node.delete_sandbox("b-good"))
        b.run(b.node.delete_sandbox("b-bad"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
