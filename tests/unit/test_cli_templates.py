"""``space template build/ls/rm`` against the control app, and ``space serve --warm-*``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result

from space.cli import CliContext, main
from space.node.api import Unavailable
from space.node.core.config import NodeConfig
from tests.unit.fakes import FakeNode, control_app

SPEC = 'name = "py"\ntag = "v1"\nbase = "debian:bookworm"\n'


class Served:
    """The control app over a FakeNode on its own loop thread, for the sync CLI."""

    def __init__(self, data_dir: Path) -> None:
        self.node = FakeNode()
        self.env: dict[str, str] = {}
        self.transport: httpx.AsyncBaseTransport | None = None
        self._data_dir = data_dir
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._done = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._run(),))

    async def _run(self) -> None:
        async with control_app(self._data_dir, self.node) as h:
            key = h.key("acme")["Authorization"].removeprefix("Bearer ")
            self.env = {"SPACE_API_KEY": key, "SPACE_API_URL": "http://space"}
            self.transport = httpx.ASGITransport(app=h.app)
            self._ready.set()
            await self._done.wait()

    def __enter__(self) -> Served:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._done.set)
        self._thread.join(10)
        self._loop.close()

    def space(self, *args: str) -> Result:
        obj = CliContext(transport=self.transport)
        return CliRunner().invoke(main, [*args], obj=obj, env=self.env)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with Served(tmp_path / "data") as served:
        yield served


def project(root: Path, spec: str = SPEC, name: str = "space.toml") -> Path:
    root.mkdir()
    (root / name).write_text(spec)
    (root / "app.py").write_text("print(1)\n")
    return root


def test_build_prints_the_log_then_the_built_reference(served: Served, tmp_path: Path) -> None:
    result = served.space("template", "build", str(project(tmp_path / "p")))
    assert result.exit_code == 0, result.output
    log, last = result.stdout.splitlines()[:-1], result.stdout.splitlines()[-1]
    assert log == ["step 1/2 run: building py:v1", "step 2/2 config: done"]
    assert last.startswith("built py:v1 ") and len(last.split()[-1]) == 64


def test_build_sends_the_spec_named_with_f_as_space_toml(served: Served, tmp_path: Path) -> None:
    root = project(tmp_path / "p", name="prod.toml")
    result = served.space("template", "build", str(root), "-f", "prod.toml")
    assert result.exit_code == 0, result.output
    assert served.node.contexts[0]["space.toml"] is not None


def test_negative_a_failed_build_exits_1_with_the_error(served: Served, tmp_path: Path) -> None:
    root = project(tmp_path / "p", SPEC + '[[steps]]\nrun = "fail"\n')
    result = served.space("template", "build", str(root))
    assert result.exit_code == 1
    assert "boom" in result.stdout.splitlines()
    assert result.stderr.startswith("error: build_failed: step 1: py: step failed")


def test_negative_a_symlink_outside_fails_before_sending(served: Served, tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    (root / "leak").symlink_to("/etc/hostname")
    result = served.space("template", "build", str(root))
    assert result.exit_code == 1 and "points outside" in result.stderr
    assert served.node.contexts == []


def test_ls_shows_a_table_and_rm_deletes(served: Served, tmp_path: Path) -> None:
    assert served.space("template", "build", str(project(tmp_path / "p"))).exit_code == 0
    table = served.space("template", "ls").stdout.splitlines()
    assert table[0].split() == ["NAME:TAG", "DIGEST", "BASE", "CPUS/MEM/DISK", "READY", "CREATED"]
    row = table[2].split()
    assert row[:5] == ["py:v1", row[1], "debian:bookworm", "1/256/2048", "no"]
    assert len(row[1]) == 12
    assert served.space("template", "rm", "py:v1").exit_code == 0
    assert [line.split()[0] for line in served.space("template", "ls").stdout.splitlines()] == [
        "NAME:TAG", "base:latest",
    ]  # fmt: skip
    again = served.space("template", "rm", "py:v1")
    assert again.exit_code == 1 and again.stderr.startswith("error: not_found:")


def _serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str) -> tuple[Result, Any]:
    """Run ``space serve ARGS`` with a Node.start that records its config and stops."""
    from space.node.agent import Node

    seen: dict[str, NodeConfig] = {}

    async def start(config: NodeConfig, **_: object) -> None:
        seen["config"] = config
        raise Unavailable("stopped by the test")

    monkeypatch.setattr(Node, "start", staticmethod(start))
    result = CliRunner().invoke(main, ["serve", "--data-dir", str(tmp_path), *args])
    return result, seen.get("config")


def test_serve_passes_the_warm_pool_bounds_to_the_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    result, config = _serve(monkeypatch, tmp_path, "--warm-min", "1", "--warm-max", "1")
    assert "stopped by the test" in result.stderr
    assert (config.warm_pool_min, config.warm_pool_max) == (1, 1)
    _, default = _serve(monkeypatch, tmp_path)
    assert (default.warm_pool_min, default.warm_pool_max) == (0, 0)


def test_serve_passes_the_admission_settings_to_the_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    args = ("--max-sandboxes", "150", "--memory-reserve-mib", "4096")
    _, config = _serve(monkeypatch, tmp_path, *args, "--memory-overcommit", "1.5")
    assert (config.max_sandboxes, config.memory_reserve_mib) == (150, 4096)
    assert (config.memory_overcommit, config.pool_reserve_mib) == (1.5, None)
    _, default = _serve(monkeypatch, tmp_path)
    assert default.capacity == NodeConfig(data_dir=tmp_path).capacity
    assert default.max_sandboxes is None


def test_serve_passes_the_build_slots_to_the_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, config = _serve(monkeypatch, tmp_path, "--build-slots", "5")
    assert config.build_slots == 5
    _, default = _serve(monkeypatch, tmp_path)
    assert default.build_slots == NodeConfig(data_dir=tmp_path).build_slots == 2


def test_serve_passes_what_auto_means_without_kvm_to_the_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, config = _serve(monkeypatch, tmp_path, "--guest-without-kvm", "gvisor")
    assert config.guest_without_kvm == "gvisor"
    _, default = _serve(monkeypatch, tmp_path)
    assert default.guest_without_kvm == "qemu"


def test_serve_passes_the_pool_size_to_the_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, config = _serve(monkeypatch, tmp_path, "--pool-size-gib", "64")
    assert config.pool_size_gib == 64
    _, default = _serve(monkeypatch, tmp_path)
    assert default.pool_size_gib == NodeConfig(data_dir=tmp_path).pool_size_gib == 20


def test_a_node_alone_takes_the_same_admission_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from space.node.agent import Node

    seen: list[NodeConfig] = []

    async def start(config: NodeConfig, **_: object) -> None:
        seen.append(config)
        raise Unavailable("stopped by the test")

    monkeypatch.setattr(Node, "start", staticmethod(start))
    token = tmp_path / "token"
    token.write_text("secret\n")
    args = ["node", "--control-url", "http://ctl:8080", "--token-file", str(token)]
    args += ["--data-dir", str(tmp_path), "--max-sandboxes", "7", "--pool-reserve-mib", "512"]
    result = CliRunner().invoke(main, args)
    assert "stopped by the test" in result.stderr
    assert (seen[0].max_sandboxes, seen[0].pool_reserve_mib) == (7, 512)


@pytest.mark.parametrize(
    "args",
    [
        ("--warm-min", "2", "--warm-max", "1"),
        ("--warm-min", "-1"),
        ("--warm-max", "-1"),
        ("--max-sandboxes", "0"),
        ("--memory-overcommit", "0"),
        ("--pool-reserve-mib", "-1"),
        ("--build-slots", "0"),
        ("--pool-size-gib", "1"),
    ],
)
def test_negative_bad_pool_or_admission_settings_exit_2_without_starting_a_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: tuple[str, ...]
) -> None:
    result, config = _serve(monkeypatch, tmp_path, *args)
    assert result.exit_code == 2 and config is None
