"""The parts of a template build that need no VM: output lines, the log, the shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space.node.agent import _builder, _builds
from space.node.agent._builder import MAX_LINE, _lines, _shape
from space.node.agent._builds import _Log
from space.node.api import (
    BuildFailed,
    BuildLog,
    ExecEvent,
    ExecExited,
    ExecOutput,
    InsufficientCapacity,
    NodeError,
    Timeout,
    Unavailable,
)
from space.node.core.template import BASE, READY_SHAPE, Shape, Template
from space.node.storage.btrfs import TemplateVolume
from space.node.templates import TemplateSpec, TemplateSpecError, parse_spec

pytestmark = pytest.mark.anyio


class _Stream:
    pid, process_id, pty = 1, "p1", False

    def __init__(self, events: list[ExecEvent]) -> None:
        self._events = events

    async def __aiter__(self) -> AsyncIterator[ExecEvent]:
        for event in self._events:
            yield event

    async def aclose(self) -> None:
        pass


async def test_output_is_passed_on_line_by_line_across_chunks_and_streams() -> None:
    events: list[ExecEvent] = [
        ExecOutput("stdout", b"one\ntw"),
        ExecOutput("stderr", b"err\r\n"),
        ExecOutput("stdout", b"o\nthree"),
        ExecExited(0, None),
    ]
    seen: list[str] = []
    exits = [e async for e in _lines(_Stream(events), seen.append)]
    assert seen == ["one", "err", "two", "three"]
    assert exits == [ExecExited(0, None)]


async def test_a_line_longer_than_the_limit_is_cut_not_held() -> None:
    seen: list[str] = []
    events: list[ExecEvent] = [ExecOutput("stdout", b"x" * (3 * MAX_LINE)), ExecExited(0, None)]
    async for _ in _lines(_Stream(events), seen.append):
        pass
    assert seen and all(len(line) <= MAX_LINE for line in seen)


async def test_a_slow_listener_loses_log_lines_counted_but_never_the_outcome(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_builds, "_BACKLOG", 5)
    log = _Log()
    for n in range(20):
        log.say(f"line {n}")
    log.end(BuildFailed("build_failed", "step 2 failed", 1))
    events = [event async for event in log.events()]
    assert isinstance(events[-1], BuildFailed) and events[-1].step == 1
    assert len(events) <= 5


async def test_a_closed_listener_gets_nothing_and_blocks_nothing() -> None:
    log = _Log()
    log.closed = True
    for n in range(20_000):
        log.say(f"line {n}")
    log.end(BuildFailed("internal", "never seen"))
    assert log._queue.empty()


async def test_lines_arrive_in_order_then_the_outcome() -> None:
    log = _Log()
    log.say("a")
    log.say("b")
    log.end(BuildFailed("internal", "boom"))
    log.say("after")  # never seen: the stream ended
    events = [event async for event in log.events()]
    assert events == [BuildLog("a"), BuildLog("b"), BuildFailed("internal", "boom")]


def _base(tmp_path: Path, *, pristine: bool, disk_mib: int = 1024) -> Template:
    path = tmp_path / "base"
    path.mkdir()
    with open(path / "rootfs.img", "wb") as image:
        image.truncate(disk_mib << 20)
    volume = TemplateVolume(BASE, "b" * 64, path)
    shape = READY_SHAPE if pristine else Shape(2, 512, disk_mib)
    return Template(BASE, "latest", volume, "", disk_mib, pristine=pristine, shape=shape)


def _spec(resources: str = "") -> TemplateSpec:
    text = f'name = "t"\nbase = "debian:bookworm"\n{resources}'
    return parse_spec(text, spec_dir=Path("."))


def test_the_shape_takes_the_specs_resources_then_the_bases(tmp_path: Path) -> None:
    pristine = _base(tmp_path, pristine=True)
    assert _shape(_spec(), pristine) == READY_SHAPE
    sized = _spec("[resources]\ncpus = 2\ndisk_mib = 4096\n")
    assert _shape(sized, pristine) == Shape(2, 256, 4096)


def test_negative_a_template_on_a_built_one_keeps_its_disk(tmp_path: Path) -> None:
    built = _base(tmp_path, pristine=False, disk_mib=2048)
    assert _shape(_spec(), built) == Shape(2, 512, 2048)
    with pytest.raises(TemplateSpecError) as caught:
        _shape(_spec("[resources]\ndisk_mib = 4096\n"), built)
    assert caught.value.key == "resources.disk_mib"


async def test_a_build_vm_dying_at_boot_is_booted_again_once_and_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    booted: list[str] = []

    async def boot(node: object, vm_id: str, *args: object, **kwargs: object) -> str:
        booted.append(vm_id)
        if len(booted) <= failures:
            raise error
        return vm_id

    monkeypatch.setattr(_builder, "boot_hidden", boot)
    source = TemplateVolume("base", "d" * 12, Path("/nowhere"))
    shape = Shape(2, 1024, 1024)
    said: list[str] = []

    error: NodeError = Unavailable("guest HELLO failed: reset; console tail:\npanic")
    failures = 1
    vm: object = await _builder._boot_build_vm(None, source, shape, False, said.append)  # type: ignore[arg-type]
    assert vm == booted[1] != booted[0]
    assert said == ["the build VM died at boot; booting another (the node's log has its console)"]

    booted.clear()
    failures = 2
    with pytest.raises(Unavailable, match="reset"):
        await _builder._boot_build_vm(None, source, shape, False, said.append)  # type: ignore[arg-type]
    assert len(booted) == 2

    for error in (InsufficientCapacity("no room"), Timeout("no HELLO within 60 s")):
        booted.clear()
        with pytest.raises(type(error)):
            await _builder._boot_build_vm(None, source, shape, False, said.append)  # type: ignore[arg-type]
        assert len(booted) == 1
