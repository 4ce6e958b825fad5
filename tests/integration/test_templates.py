"""Templates built from a spec on a real node: steps in a build VM, layers, ready state.

Each build boots one build VM (from the last cached layer) and one VM for the ready
state, so these tests take about half a minute per build under TCG.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import tarfile
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from space.node.agent import Node
from space.node.api import (
    BuildEvent,
    BuildFailed,
    BuildLog,
    BuildSucceeded,
    NotFound,
    SandboxSpec,
    SandboxState,
    TemplateInfo,
)
from space.node.core.config import NodeConfig
from tests.apt_repo import served_repository

from .conftest import NodeHarness, started_node
from .test_lifecycle import _sh

pytestmark = pytest.mark.vm


@contextlib.contextmanager
def _removing_templates(h: NodeHarness) -> Iterator[NodeHarness]:
    """``h``; afterwards every template but base is deleted, so the node's later
    starts (in other test files, on the same data dir) make no ready state or pool
    for them."""
    try:
        yield h
    finally:
        for info in h.run(h.node.list_templates()):
            if info.name != "base":
                with contextlib.suppress(NotFound):
                    h.run(h.node.delete_template(f"{info.name}@{info.digest}"))


@pytest.fixture
def node(node_config: NodeConfig) -> Iterator[NodeHarness]:
    with started_node(node_config) as harness, _removing_templates(harness):
        yield harness


_SERVER = """#!/bin/sh
# Stays running: the template's start command.
while true; do date +%s > /tmp/alive; sleep 1; done
"""


#: The command lines of the guest's processes (the image has no procps).
_PROCESSES = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"


def _spec(run_steps: list[str], *, name: str = "webapp", tag: str = "v1") -> str:
    steps = "".join(f"\n[[steps]]\nrun = '''{cmd}'''\n" for cmd in run_steps)
    return (
        textwrap.dedent(f"""\
        name = "{name}"
        tag = "{tag}"
        base = "debian:bookworm"
        env = {{ GREETING = "hello from the template" }}
        workdir = "/opt/app"
        start = "sh /opt/app/server.sh"

        [[steps]]
        copy = {{ src = "app", dst = "/opt/app" }}
        """)
        + steps
    )


def _context(directory: Path, spec: str) -> AsyncIterator[bytes]:
    (directory / "space.toml").write_text(spec)
    app = directory / "app"
    app.mkdir(exist_ok=True)
    (app / "server.sh").write_text(_SERVER)
    (app / "server.sh").chmod(0o755)
    (app / "data.txt").write_text("template data\n")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path in sorted(directory.rglob("*")):
            archive.add(path, arcname=str(path.relative_to(directory)), recursive=False)
    data = buffer.getvalue()

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(data), 4096):
            yield data[start : start + 4096]

    return chunks()


async def _build(node: Node, context: AsyncIterator[bytes]) -> list[BuildEvent]:
    stream = await node.build_template(context)
    return [event async for event in stream]


def _logs(events: list[BuildEvent]) -> list[str]:
    return [event.line for event in events if isinstance(event, BuildLog)]


def _built(events: list[BuildEvent]) -> TemplateInfo:
    outcome = events[-1]
    assert isinstance(outcome, BuildSucceeded), "\n".join(_logs(events)) + f"\n{outcome}"
    return outcome.template


def test_a_built_template_gives_its_sandboxes_files_env_workdir_and_a_running_start_command(
    node: NodeHarness, tmp_path: Path
) -> None:
    spec = _spec(["echo built-by-a-run-step > /opt/built", "id -un > /opt/who"])
    events = node.run(_build(node.node, _context(tmp_path, spec)))
    info = _built(events)
    assert (info.name, info.tag, info.ready) == ("webapp", "v1", True)
    assert (info.start, info.workdir, info.cpus) == ("sh /opt/app/server.sh", "/opt/app", 1)
    assert any(line.startswith("step 3/4 run") for line in _logs(events))
    assert "webapp" in {t.name for t in node.run(node.node.list_templates())}

    status = node.run(node.node.create_sandbox(SandboxSpec("from-tpl", template="webapp:v1")))
    assert status.state == SandboxState.RUNNING
    assert _sh(node, "from-tpl", "cat /opt/app/data.txt /opt/built /opt/who") == (
        "template data\nbuilt-by-a-run-step\nroot"
    )
    assert _sh(node, "from-tpl", "stat -c %a /opt/app/server.sh") == "755"
    assert _sh(node, "from-tpl", 'echo "$GREETING"; pwd') == "hello from the template\n/opt/app"
    assert "server.sh" in _sh(node, "from-tpl", _PROCESSES)  # from the ready state
    # Another shape boots the template and starts the command itself.
    node.run(node.node.create_sandbox(SandboxSpec("tpl-2cpu", template="webapp:v1", cpus=2)))
    assert "server.sh" in _sh(node, "tpl-2cpu", _PROCESSES)


def test_a_changed_step_rebuilds_from_it_on_and_a_failing_step_keeps_the_previous_build(
    node: NodeHarness, tmp_path: Path
) -> None:
    first = _built(node.run(_build(node.node, _context(tmp_path, _spec(["echo one > /opt/n"])))))
    events = node.run(_build(node.node, _context(tmp_path, _spec(["echo two > /opt/n"]))))
    second = _built(events)
    logs = _logs(events)
    assert any(line.startswith("step 1/3 copy") and line.endswith("(cached)") for line in logs)
    assert not any(line.startswith("step 2/3 run") and "(cached)" in line for line in logs)
    assert second.digest != first.digest
    with pytest.raises(NotFound):  # the tag moved on and no other names the first build
        node.node.pool.template("webapp", first.digest)

    failing = _spec(["echo two > /opt/n", "echo boom-output; exit 3"])
    events = node.run(_build(node.node, _context(tmp_path, failing)))
    outcome = events[-1]
    assert isinstance(outcome, BuildFailed), outcome
    assert (outcome.code, outcome.step) == ("build_failed", 2)
    assert "exited with code 3" in outcome.message and "boom-output" in outcome.message
    assert "boom-output" in _logs(events)

    node.run(node.node.create_sandbox(SandboxSpec("after-fail", template="webapp:v1")))
    assert _sh(node, "after-fail", "cat /opt/n") == "two"  # still the second build
    built = node.node.pool.root / "templates" / "webapp"
    assert {p.name for p in built.glob(f"{second.digest}*")} >= {
        f"{second.digest}.ready",
        f"{second.digest}.gvisor-ready",  # where the node offers gVisor, as here
    }
    node.run(node.node.delete_template(f"webapp@{second.digest}"))
    assert list(built.glob(f"{second.digest}*")) == []  # its ready states went with it
    with pytest.raises(NotFound):
        node.run(node.node.create_sandbox(SandboxSpec("gone", template="webapp:v1")))
    assert _sh(node, "after-fail", "cat /opt/n") == "two"  # its sandboxes live on


def test_packages_are_fetched_by_the_host_and_installed_in_the_build_vm(
    node_config: NodeConfig, tmp_path: Path
) -> None:
    spec = 'name = "with-packages"\nbase = "debian:bookworm"\npackages = ["space-app"]\n'
    with (
        served_repository(tmp_path / "repo") as source,
        started_node(replace(node_config, apt_sources=(source,))) as started,
        _removing_templates(started) as node,
    ):
        context = tmp_path / "context"
        context.mkdir()
        events = node.run(_build(node.node, _context(context, spec)))
        _built(events)
        assert any("space-app" in line for line in _logs(events))
        node.run(node.node.create_sandbox(SandboxSpec("pkg", template="with-packages")))
        installed = _sh(node, "pkg", "cat /usr/share/space-*/installed | sort")
        assert installed == "space-app 1:2.0\nspace-base 1.0\nspace-lib 1.0"
        assert _sh(node, "pkg", "dpkg-query -W -f '${Status}' space-app") == "install ok installed"
        assert _sh(node, "pkg", "ls /var/cache/space-build 2>/dev/null | wc -l") == "0"


def test_b_s_one_step_build_finishes_while_a_s_slow_build_runs(
    node: NodeHarness, tmp_path: Path
) -> None:
    # Node-internal names of two tenants' templates (space/control/template_names.py).
    slow_name, quick_name = "t" + "a" * 16 + ".slow", "t" + "b" * 16 + ".quick"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()

    async def until_sleeping() -> tuple[AsyncIterator[BuildEvent], list[BuildEvent]]:
        slow = await node.node.build_template(
            _context(tmp_path / "a", _spec(["sleep 600"], name=slow_name))
        )
        events = aiter(slow)
        seen: list[BuildEvent] = []
        async with asyncio.timeout(180):
            while not any(line.startswith("step 2/3 run") for line in _logs(seen)):
                seen.append(await anext(events))
        return events, seen

    slow_events, slow_seen = node.run(until_sleeping())
    started = time.monotonic()
    quick = node.run(_build(node.node, _context(tmp_path / "b", _spec([], name=quick_name))))
    quick_s = time.monotonic() - started
    assert _built(quick).name == quick_name
    assert not any("waiting" in line for line in _logs(quick))
    assert not any(isinstance(event, BuildSucceeded | BuildFailed) for event in slow_seen)

    # A's build is still in its sleep: stopping the node's builds ends it, tag unmoved.
    node.run(node.node.templates.close())
    rest = node.run(_collect(slow_events))
    outcome = rest[-1]
    assert isinstance(outcome, BuildFailed) and outcome.code == "unavailable", outcome
    assert slow_name not in {t.name for t in node.run(node.node.list_templates())}
    print(f"B's one-step build took {quick_s:.1f} s while A's build slept")


async def _collect(events: AsyncIterator[BuildEvent]) -> list[BuildEvent]:
    async with asyncio.timeout(60):
        return [event async for event in events]
