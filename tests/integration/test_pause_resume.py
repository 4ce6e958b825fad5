"""Pause and resume on real VMs: vCPUs stop, memory stays, resume is immediate.

Each test boots one VM (TCG boots take seconds on these machines). QEMU's own run state
is read through the node's QMP client (``Node._registry``): QMP allows one client per
socket, so the test cannot open a second one.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from space.node.agent import Node
from space.node.api import (
    Conflict,
    ExecExited,
    ExecOutput,
    ExecRequest,
    NotFound,
    SandboxSpec,
    SandboxState,
)
from space.node.vmm.qemu import QemuVM

from ..guest_programs import COUNTER_FILE, counter
from .conftest import NodeHarness
from .platform import qemu_pids

pytestmark = pytest.mark.vm

_COUNTER = counter(0.1)
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


async def _run(node: Node, sandbox_id: str, request: ExecRequest) -> tuple[str, int | None]:
    stream = await node.exec(sandbox_id, request)
    out, code = b"", None
    async for event in stream:
        if isinstance(event, ExecOutput) and event.stream == "stdout":
            out += event.data
        elif isinstance(event, ExecExited):
            code = event.exit_code
    return out.decode(), code


async def _read(node: Node, sandbox_id: str, path: str) -> bytes:
    reader = await node.read_file(sandbox_id, path)
    try:
        return b"".join([chunk async for chunk in reader])
    finally:
        await reader.aclose()


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _qmp_status(h: NodeHarness, sandbox_id: str) -> str:
    vm = h.node._registry.get(sandbox_id).vm
    assert isinstance(vm, QemuVM)
    return h.run(vm.query_status())


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def _counter(h: NodeHarness, sandbox_id: str) -> int:
    out, code = h.run(_run(h.node, sandbox_id, ExecRequest(argv=["cat", COUNTER_FILE])))
    assert code == 0
    return int(out)


def _guest_clock_offset_s(h: NodeHarness, sandbox_id: str) -> float:
    out, _ = h.run(_run(h.node, sandbox_id, ExecRequest(argv=["date", "+%s.%N"])))
    return float(out) - time.time()


def _leftovers(h: NodeHarness, sandbox_id: str, pid: int | None) -> list[str]:
    left = [f"qemu pid {pid}"] if pid is not None and Path(f"/proc/{pid}").exists() else []
    data = h.config.data_dir
    for path in (
        data / "pool" / "sandboxes" / sandbox_id,
        data / "sandboxes" / f"{sandbox_id}.json",
        h.config.effective_run_dir / sandbox_id,
    ):
        if path.exists():
            left.append(str(path))
    return left


def test_paused_sandbox_stops_its_vcpus_and_resumes_fast(
    node: NodeHarness, record_property: Callable[[str, object], None]
) -> None:
    sid = "it-pause"
    status = node.run(node.node.create_sandbox(SandboxSpec(sid, memory_mib=256)))
    pid = status.vmm_pid
    assert pid is not None
    bg = node.run(node.node.exec(sid, ExecRequest(cmd=_COUNTER, background=True)))
    node.run(bg.aclose())
    time.sleep(1.0)
    offset_before = _guest_clock_offset_s(node, sid)
    before = _counter(node, sid)

    paused = node.run(node.node.pause_sandbox(sid))
    assert paused.state == SandboxState.PAUSED
    assert node.run(node.node.pause_sandbox(sid)) == paused  # idempotent
    assert _qmp_status(node, sid) == "paused"
    state_file = node.config.data_dir / "sandboxes" / f"{sid}.json"
    assert '"state": "paused"' in state_file.read_text()
    cpu_start = _cpu_s(pid)
    time.sleep(1.0)
    paused_cpu_s = _cpu_s(pid) - cpu_start

    start = time.monotonic()
    resumed = node.run(node.node.resume_sandbox(sid))
    resume_ms = (time.monotonic() - start) * 1000
    assert resumed.state == SandboxState.RUNNING
    assert _qmp_status(node, sid) == "running"
    after = _counter(node, sid)
    offset_after = _guest_clock_offset_s(node, sid)
    time.sleep(0.5)
    later = _counter(node, sid)

    record_property("resume_ms", round(resume_ms, 1))
    record_property("paused_cpu_s_per_s", round(paused_cpu_s, 3))
    print(
        f"\nresume {resume_ms:.1f} ms; QEMU CPU while paused {paused_cpu_s:.3f} s/s; "
        f"counter {before} -> {after} across 1 s paused, {later} 0.5 s later; "
        f"guest clock lag after the pause {offset_before - offset_after:+.2f} s"
    )
    # A 1 s pause would have advanced a running counter by ~10.
    assert paused_cpu_s < 0.1
    assert after - before <= 3
    assert later > after
    assert resume_ms < 500


def test_exec_on_a_paused_sandbox_resumes_it_and_delete_of_a_paused_one_leaves_nothing(
    node: NodeHarness,
) -> None:
    sid = "it-autoresume"
    pid = node.run(node.node.create_sandbox(SandboxSpec(sid))).vmm_pid
    node.run(node.node.pause_sandbox(sid))

    out, code = node.run(_run(node.node, sid, ExecRequest(argv=["echo", "awake"])))

    assert (out, code) == ("awake\n", 0)
    assert node.run(node.node.get_sandbox(sid)).state == SandboxState.RUNNING
    assert _qmp_status(node, sid) == "running"
    node.run(node.node.pause_sandbox(sid))
    node.run(node.node.delete_sandbox(sid))
    assert _leftovers(node, sid, pid) == []
    assert qemu_pids(node.config.data_dir) == []
    with pytest.raises(NotFound):
        node.run(node.node.pause_sandbox(sid))


def test_node_restart_keeps_a_paused_sandbox_paused(node: NodeHarness) -> None:
    sid = "it-pause-restart"
    status = node.run(node.node.create_sandbox(SandboxSpec(sid)))
    node.run(node.node.write_file(sid, "/tmp/kept", _one(b"before the restart")))
    node.run(node.node.pause_sandbox(sid))

    node.restart()

    again = node.run(node.node.get_sandbox(sid))
    assert (again.state, again.vmm_pid) == (SandboxState.PAUSED, status.vmm_pid)
    assert _qmp_status(node, sid) == "paused"
    assert node.run(_read(node.node, sid, "/tmp/kept")) == b"before the restart"
    assert node.run(node.node.get_sandbox(sid)).state == SandboxState.RUNNING


def test_twenty_pause_resume_cycles_keep_every_file_intact(
    node: NodeHarness, record_property: Callable[[str, object], None]
) -> None:
    sid = "it-cycles"
    status = node.run(node.node.create_sandbox(SandboxSpec(sid)))
    pause_ms, resume_ms = [], []
    for cycle in range(20):
        data = f"cycle {cycle}\n".encode() * (cycle + 1)
        node.run(node.node.write_file(sid, f"/tmp/f{cycle}", _one(data)))
        start = time.monotonic()
        node.run(node.node.pause_sandbox(sid))
        pause_ms.append((time.monotonic() - start) * 1000)
        start = time.monotonic()
        node.run(node.node.resume_sandbox(sid))
        resume_ms.append((time.monotonic() - start) * 1000)

    for cycle in range(20):
        expected = f"cycle {cycle}\n".encode() * (cycle + 1)
        assert node.run(_read(node.node, sid, f"/tmp/f{cycle}")) == expected, cycle
    record_property("pause_ms_median", round(statistics.median(pause_ms), 1))
    record_property("resume_ms_median", round(statistics.median(resume_ms), 1))
    print(
        f"\n20 cycles: pause median {statistics.median(pause_ms):.1f} ms, "
        f"resume median {statistics.median(resume_ms):.1f} ms"
    )

    # A sandbox whose VM died is in error: pausing it is a Conflict naming the state.
    assert status.vmm_pid is not None
    os.kill(status.vmm_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while node.run(node.node.get_sandbox(sid)).state != SandboxState.ERROR:
        assert time.monotonic() < deadline, "sandbox did not go to error"
        time.sleep(0.05)
    with pytest.raises(Conflict, match="error"):
        node.run(node.node.pause_sandbox(sid))
    with pytest.raises(Conflict, match="error"):
        node.run(node.node.resume_sandbox(sid))
