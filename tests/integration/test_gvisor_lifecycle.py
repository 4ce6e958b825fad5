"""gVisor sandboxes through saved memory on a real node (issue 21): pause and resume
(``runsc pause``), hibernate and wake, snapshots, restore and fork (``runsc
checkpoint`` sealed into the volume, ``runsc restore`` on a new channel), each giving
back the same processes and files, a restored copy a fresh identity.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from space.node.api import (
    ExecRequest,
    InvalidArgument,
    PoolInfo,
    SandboxSpec,
    SandboxState,
)
from space.node.core.config import NodeConfig
from space.node.core.sandbox import hostname_for
from space.node.network import netns
from space.node.vmm.gvisor import runsc_home
from space.node.vmm.sealed_state import MAGIC

from .conftest import NodeHarness, started_node
from .test_gvisor import (
    _chunks,
    _leftovers,
    _read,
    _run,
    _runsc_processes,
    gvisor_node,
    ruleset_of,
)

__all__ = ["gvisor_node"]  # the fixture, shared with test_gvisor

pytestmark = pytest.mark.vm

#: A process whose state lives only in its memory: it counts, and answers with the
#: count and its pid whenever /tmp/ask appears.
_KEEPER = (
    "import os, time\n"
    "n = 0\n"
    "while True:\n"
    "    n += 1\n"
    "    if os.path.exists('/tmp/ask'):\n"
    "        os.unlink('/tmp/ask')\n"
    "        open('/tmp/answer.new', 'w').write(f'{os.getpid()} {n}')\n"
    "        os.rename('/tmp/answer.new', '/tmp/answer')\n"
    "    time.sleep(0.02)\n"
)


def _runsc_state(h: NodeHarness, name: str) -> str:
    home = runsc_home(h.config.effective_run_dir)
    out = subprocess.run(
        ["runsc", f"--root={home / 'state'}", "state", name],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out


def _start_keeper(h: NodeHarness, sid: str) -> None:
    h.run(h.node.write_file(sid, "/home/user/keeper.py", _chunks(_KEEPER.encode())))
    stream = h.run(
        h.node.exec(sid, ExecRequest(argv=["python3", "/home/user/keeper.py"], background=True))
    )
    h.run(stream.aclose())


def _ask_keeper(h: NodeHarness, sid: str) -> tuple[int, int]:
    """(pid, count) of the keeper, asked through a file it polls."""
    out, err, code = _run(
        h,
        sid,
        ExecRequest(
            cmd="rm -f /tmp/answer; touch /tmp/ask; "
            "for i in $(seq 200); do [ -e /tmp/answer ] && break; sleep 0.05; done; "
            "cat /tmp/answer"
        ),
    )
    assert code == 0, err
    pid, count = out.split()
    return int(pid), int(count)


def _identity(h: NodeHarness, sid: str) -> tuple[str, str]:
    """(hostname, machine-id); the image's machine-id is empty until a restore."""
    out, _, code = _run(h, sid, ExecRequest(cmd="hostname; cat /etc/machine-id; echo"))
    assert code == 0
    hostname, machine_id = out.split("\n")[:2]
    return hostname, machine_id


def test_gvisor_pause_stops_its_tasks_and_resume_gives_them_back(
    gvisor_node: NodeHarness, record_property: Callable[[str, object], None]
) -> None:
    h, sid = gvisor_node, "gv-pause"
    h.run(h.node.create_sandbox(SandboxSpec(sid, guest="gvisor")))
    try:
        _start_keeper(h, sid)
        h.run(h.node.write_file(sid, "/home/user/kept", _chunks(b"across the pause")))
        pid, count = _ask_keeper(h, sid)
        pause_ms, resume_ms = [], []
        for _ in range(5):
            start = time.monotonic()
            status = h.run(h.node.pause_sandbox(sid))
            pause_ms.append((time.monotonic() - start) * 1000)
            assert status.state == SandboxState.PAUSED
            assert h.run(h.node.pause_sandbox(sid)) == status  # idempotent
            assert '"status": "paused"' in _runsc_state(h, sid)
            start = time.monotonic()
            assert h.run(h.node.resume_sandbox(sid)).state == SandboxState.RUNNING
            resume_ms.append((time.monotonic() - start) * 1000)
            assert '"status": "running"' in _runsc_state(h, sid)
        again_pid, again = _ask_keeper(h, sid)
        assert again_pid == pid and again > count  # the same process, counting on
        assert _read(h, sid, "/home/user/kept") == b"across the pause"

        # As a paused VM: a guest operation resumes it first, transparently.
        h.run(h.node.pause_sandbox(sid))
        out, _, code = _run(h, sid, ExecRequest(argv=["echo", "awake"]))
        assert (out, code) == ("awake\n", 0)
        assert h.run(h.node.get_sandbox(sid)).state == SandboxState.RUNNING
        # While paused its tasks stand still: the keeper does not count.
        h.run(h.node.pause_sandbox(sid))
        time.sleep(0.5)
        h.run(h.node.resume_sandbox(sid))
        record_property("pause_ms_p50", round(statistics.median(pause_ms), 1))
        record_property("resume_ms_p50", round(statistics.median(resume_ms), 1))
        print(
            f"\ngvisor pause p50 {statistics.median(pause_ms):.1f} ms, "
            f"resume p50 {statistics.median(resume_ms):.1f} ms"
        )
        h.run(h.node.pause_sandbox(sid))  # deleted while paused
    finally:
        h.run(h.node.delete_sandbox(sid))
    assert _leftovers(h, sid) == []


def test_gvisor_hibernate_and_wake_keep_processes_and_files_with_the_state_sealed(
    gvisor_node: NodeHarness, record_property: Callable[[str, object], None]
) -> None:
    h, sid = gvisor_node, "gv-hib"
    h.run(h.node.create_sandbox(SandboxSpec(sid, guest="gvisor")))
    bundle = runsc_home(h.config.effective_run_dir) / "bundles" / sid
    volume = h.config.data_dir / "pool" / "sandboxes" / sid
    try:
        _start_keeper(h, sid)
        h.run(h.node.write_file(sid, "/home/user/kept", _chunks(b"across hibernation")))
        pid, count = _ask_keeper(h, sid)
        identity = _identity(h, sid)
        hibernate_ms, wake_ms = [], []
        for _ in range(3):
            start = time.monotonic()
            status = h.run(h.node.hibernate_sandbox(sid))
            hibernate_ms.append((time.monotonic() - start) * 1000)
            assert (status.state, status.vmm_pid) == (SandboxState.HIBERNATED, None)
            assert _runsc_processes(bundle) == []
            # The checkpoint is sealed under the node's state key, in the volume.
            with open(volume / "vmstate", "rb") as state:
                assert state.read(len(MAGIC)) == MAGIC
            assert not list((runsc_home(h.config.effective_run_dir) / "images").iterdir())
            start = time.monotonic()
            assert h.run(h.node.resume_sandbox(sid)).state == SandboxState.RUNNING
            wake_ms.append((time.monotonic() - start) * 1000)
            assert not (volume / "vmstate").exists()
        again_pid, again = _ask_keeper(h, sid)
        assert again_pid == pid and again > count
        assert _read(h, sid, "/home/user/kept") == b"across hibernation"
        assert _identity(h, sid) == identity  # a wake is the same machine
        # A guest operation wakes a hibernated sandbox, as it does a VM.
        h.run(h.node.hibernate_sandbox(sid))
        out, _, _ = _run(h, sid, ExecRequest(argv=["cat", "/home/user/kept"]))
        assert out == "across hibernation"
        record_property("hibernate_ms_p50", round(statistics.median(hibernate_ms), 1))
        record_property("wake_ms_p50", round(statistics.median(wake_ms), 1))
        print(
            f"\ngvisor hibernate p50 {statistics.median(hibernate_ms):.1f} ms, "
            f"wake p50 {statistics.median(wake_ms):.1f} ms"
        )
        # A hibernated gVisor sandbox is exported for a move as a VM is, its stream a
        # full one (its volume is a clone of this node's tree, no template subvolume);
        # a move that does not happen leaves it as it was.
        h.run(h.node.hibernate_sandbox(sid))
        ticket = h.run(h.node.export_sandbox(sid))
        assert ticket.parents == [] and ticket.record["guest"] == "gvisor"
        h.run(h.node.finish_export(sid, ticket.ticket, moved=False))
        assert h.run(h.node.get_sandbox(sid)).state == SandboxState.HIBERNATED
        assert _read(h, sid, "/home/user/kept") == b"across hibernation"
    finally:
        h.run(h.node.delete_sandbox(sid))
    assert _leftovers(h, sid) == []


def test_gvisor_snapshot_restore_rolls_back_files_and_processes_with_a_fresh_identity(
    gvisor_node: NodeHarness, record_property: Callable[[str, object], None]
) -> None:
    h, sid = gvisor_node, "gv-snap"
    h.run(h.node.create_sandbox(SandboxSpec(sid, guest="gvisor")))
    try:
        _start_keeper(h, sid)
        h.run(h.node.write_file(sid, "/home/user/f", _chunks(b"at the snapshot")))
        pid, _ = _ask_keeper(h, sid)
        _, machine_id = _identity(h, sid)
        start = time.monotonic()
        info = h.run(h.node.snapshot_sandbox(sid, "gv-snap-1"))
        snapshot_ms = (time.monotonic() - start) * 1000
        assert info.guest == "gvisor" and info.memory_bytes > 0
        assert h.run(h.node.get_sandbox(sid)).state == SandboxState.RUNNING
        h.run(h.node.write_file(sid, "/home/user/f", _chunks(b"after the snapshot")))
        h.run(h.node.write_file(sid, "/home/user/g", _chunks(b"new")))
        restore_ms = []
        for _ in range(3):
            start = time.monotonic()
            status = h.run(h.node.restore_sandbox(sid, "gv-snap-1"))
            restore_ms.append((time.monotonic() - start) * 1000)
            assert status.state == SandboxState.RUNNING
        assert _read(h, sid, "/home/user/f") == b"at the snapshot"
        _, _, code = _run(h, sid, ExecRequest(argv=["test", "-e", "/home/user/g"]))
        assert code == 1
        assert _ask_keeper(h, sid)[0] == pid  # the snapshot's process runs again
        hostname, fresh = _identity(h, sid)
        assert hostname == sid and fresh != machine_id
        # A snapshot of a paused sandbox leaves it paused.
        h.run(h.node.pause_sandbox(sid))
        h.run(h.node.snapshot_sandbox(sid, "gv-snap-2"))
        assert h.run(h.node.get_sandbox(sid)).state == SandboxState.PAUSED
        assert '"status": "paused"' in _runsc_state(h, sid)
        record_property("snapshot_ms", round(snapshot_ms, 1))
        record_property("restore_ms_p50", round(statistics.median(restore_ms), 1))
        print(
            f"\ngvisor snapshot {snapshot_ms:.1f} ms, "
            f"restore p50 {statistics.median(restore_ms):.1f} ms"
        )
    finally:
        h.run(h.node.delete_sandbox(sid))
        for snap in ("gv-snap-1", "gv-snap-2"):
            h.run(h.node.delete_snapshot(snap))
    assert _leftovers(h, sid) == []


def test_gvisor_fork_gives_each_child_the_parent_s_files_and_processes_and_its_own_identity(
    gvisor_node: NodeHarness, record_property: Callable[[str, object], None]
) -> None:
    h, sid = gvisor_node, "gv-parent"
    children = ["gv-child-1", "gv-child-2"]
    h.run(h.node.create_sandbox(SandboxSpec(sid, guest="gvisor")))
    try:
        _start_keeper(h, sid)
        h.run(h.node.write_file(sid, "/home/user/f", _chunks(b"from the parent")))
        pid, _ = _ask_keeper(h, sid)
        _, parent_machine = _identity(h, sid)
        start = time.monotonic()
        forked = h.run(h.node.fork_sandbox(sid, children))
        fork_ms = (time.monotonic() - start) * 1000
        assert [(c.sandbox_id, c.state, c.guest) for c in forked] == [
            (c, SandboxState.RUNNING, "gvisor") for c in children
        ]
        assert h.run(h.node.get_sandbox(sid)).state == SandboxState.RUNNING
        machines = {parent_machine}
        for child in children:
            assert _read(h, child, "/home/user/f") == b"from the parent"
            assert _ask_keeper(h, child)[0] == pid  # the parent's process, copied
            hostname, machine_id = _identity(h, child)
            assert hostname == child
            machines.add(machine_id)
        assert len(machines) == 3
        # Each goes on alone: a child's writes are its own.
        h.run(h.node.write_file(children[0], "/home/user/f", _chunks(b"child's")))
        assert _read(h, sid, "/home/user/f") == b"from the parent"
        assert _read(h, children[1], "/home/user/f") == b"from the parent"
        assert _identity(h, sid) == (sid, parent_machine)

        # A sandbox made from a gVisor snapshot is a gVisor sandbox (``auto`` too).
        h.run(h.node.snapshot_sandbox(sid, "gv-fork-snap"))
        made = h.run(
            h.node.create_sandbox(SandboxSpec("gv-from-snap", from_snapshot="gv-fork-snap"))
        )
        assert (made.guest, made.state) == ("gvisor", SandboxState.RUNNING)
        assert _read(h, "gv-from-snap", "/home/user/f") == b"from the parent"
        with pytest.raises(InvalidArgument, match="is of a gvisor sandbox, not qemu"):
            h.run(
                h.node.create_sandbox(
                    SandboxSpec("gv-bad-snap", guest="qemu", from_snapshot="gv-fork-snap")
                )
            )
        record_property("fork_2_children_ms", round(fork_ms, 1))
        print(f"\ngvisor fork of 2 children {fork_ms:.1f} ms")
    finally:
        for child in [*children, "gv-from-snap", sid]:
            h.run(h.node.delete_sandbox(child))
        h.run(h.node.delete_snapshot("gv-fork-snap"))
    for gone in [*children, "gv-from-snap", "gv-bad-snap", sid]:
        assert _leftovers(h, gone) == []


def test_a_node_restart_re_adopts_running_and_paused_gvisor_sandboxes_with_their_processes(
    gvisor_node: NodeHarness,
) -> None:
    """runsc and each sandbox's channel relay outlive the node process, as QEMU does:
    the next node connects to the relay again, the same processes go on, and a paused
    sandbox stays paused until resumed."""
    h = gvisor_node
    sids = ("gv-up", "gv-still")
    home = runsc_home(h.config.effective_run_dir)
    try:
        for sid in sids:
            h.run(h.node.create_sandbox(SandboxSpec(sid, guest="gvisor")))
            _start_keeper(h, sid)
        before = {sid: _ask_keeper(h, sid) for sid in sids}
        h.run(h.node.pause_sandbox("gv-still"))
        processes = {sid: sorted(_runsc_processes(home / "bundles" / sid)) for sid in sids}
        node = h.restart()
        assert h.run(node.get_sandbox("gv-up")).state == SandboxState.RUNNING
        assert h.run(node.get_sandbox("gv-still")).state == SandboxState.PAUSED
        assert '"paused"' in _runsc_state(h, "gv-still")
        for sid in sids:
            assert sorted(_runsc_processes(home / "bundles" / sid)) == processes[sid]
        pid, count = _ask_keeper(h, "gv-up")
        assert pid == before["gv-up"][0] and count > before["gv-up"][1]
        assert h.run(node.resume_sandbox("gv-still")).state == SandboxState.RUNNING
        assert _ask_keeper(h, "gv-still")[0] == before["gv-still"][0]
        # Again, once the relays served a second node: each connection is a new session.
        node = h.restart()
        for sid in sids:
            assert h.run(node.get_sandbox(sid)).state == SandboxState.RUNNING
            assert _ask_keeper(h, sid)[0] == before[sid][0]
    finally:
        for sid in sids:
            h.run(h.node.delete_sandbox(sid))
    for sid in sids:
        assert _leftovers(h, sid) == []


def test_a_node_restart_keeps_a_hibernated_gvisor_sandbox_wakeable(
    gvisor_node: NodeHarness,
) -> None:
    h, sid = gvisor_node, "gv-hib-restart"
    h.run(h.node.create_sandbox(SandboxSpec(sid, guest="gvisor")))
    try:
        h.run(h.node.write_file(sid, "/home/user/kept", _chunks(b"across the restart")))
        h.run(h.node.hibernate_sandbox(sid))
        node = h.restart()
        assert h.run(node.get_sandbox(sid)).state == SandboxState.HIBERNATED
        assert h.run(node.resume_sandbox(sid)).state == SandboxState.RUNNING
        assert _read(h, sid, "/home/user/kept") == b"across the restart"
    finally:
        h.run(h.node.delete_sandbox(sid))
    assert _leftovers(h, sid) == []


def test_a_gvisor_warm_pool_serves_creates_of_its_shape(tmp_path: Path) -> None:
    """Where ``auto`` is gVisor, each template's warm pool holds gVisor sandboxes,
    started and paused: a create of its shape takes one over with a fresh identity,
    its egress policy applied after (a pool sandbox's link waits closed); another
    shape starts its own. Pool sandboxes do not outlive the node; the sandboxes made
    of them do."""
    config = NodeConfig(
        data_dir=tmp_path / "node",
        pool_size_gib=8,
        ready_state=False,
        guest_without_kvm="gvisor",
        warm_pool_min=1,
        warm_pool_max=1,
    )
    sids = ("gp-hit", "gp-big", "gp-net")
    with started_node(config) as h:

        def pool() -> PoolInfo:
            (info,) = h.run(h.node.info()).pools
            return info

        _until(lambda: pool().size == 1, "the pool to fill")
        assert h.run(h.node.create_sandbox(SandboxSpec("gp-hit"))).guest == "gvisor"
        assert (pool().hits, pool().misses) == (1, 0)
        hostname, _ = _identity(h, "gp-hit")
        assert hostname == hostname_for("gp-hit")
        h.run(h.node.write_file("gp-hit", "/home/user/mine", _chunks(b"hit")))
        _until(lambda: pool().size == 1, "the pool to refill")

        h.run(h.node.create_sandbox(SandboxSpec("gp-big", memory_mib=512)))
        # Not one the pool could serve, so not a miss (as for a VM of another shape).
        assert (pool().hits, pool().misses, pool().size) == (1, 0, 1)
        egress: dict[str, object] = {"allow": [{"domain": "example.test", "ports": [443]}]}
        h.run(h.node.create_sandbox(SandboxSpec("gp-net", egress=egress)))
        assert (pool().hits, pool().misses) == (2, 0)
        net_record = json.loads((config.data_dir / "sandboxes" / "gp-net.json").read_text())
        name = netns.netns_name(Path(net_record["run_dir"]))
        rules = ruleset_of(name)
        assert f"redirect to :{netns.PROXY_PORT}" in rules  # its policy opened it
        _until(lambda: pool().size == 1, "the pool to refill again")

        # A hit keeps its pool sandbox's run directory, so its bundle's name.
        home = runsc_home(config.effective_run_dir)
        kept = {
            Path(
                json.loads((config.data_dir / "sandboxes" / f"{sid}.json").read_text())["run_dir"]
            ).name
            for sid in ("gp-hit", "gp-net")
        }
        (waiting,) = {b.name for b in (home / "bundles").glob("pool-*")} - kept
        node = h.restart()
        assert {s.sandbox_id for s in h.run(node.list_sandboxes())} == set(sids)
        assert _read(h, "gp-hit", "/home/user/mine") == b"hit"
        _until(lambda: pool().size == 1, "the pool to refill after the restart")
        pooled = {b.name for b in (home / "bundles").glob("pool-*")} - kept
        assert len(pooled) == 1 and waiting not in pooled  # the old node's went
        for sid in sids:
            h.run(h.node.delete_sandbox(sid))
            assert _leftovers(h, sid) == []


def _until(check: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
