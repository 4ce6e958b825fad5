"""Hibernate, snapshots, restore and fork on real VMs, through the Node.

Guest RAM lives in a file in the sandbox's volume, so each of these is a device-state
save plus btrfs work. A background counter in the guest shows processes carrying on
(or rolling back); files written before each step show nothing is lost.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from space.node.api import (
    Conflict,
    ExecRequest,
    InvalidArgument,
    NotFound,
    SandboxSpec,
    SandboxState,
)

from .conftest import NodeHarness
from .platform import qemu_pids
from .test_pause_resume import _COUNTER, _counter, _guest_clock_offset_s, _one, _read, _run

pytestmark = pytest.mark.vm


def _create(h: NodeHarness, sandbox_id: str, **kw: object) -> None:
    status = h.run(h.node.create_sandbox(SandboxSpec(sandbox_id=sandbox_id, **kw)))  # type: ignore[arg-type]
    assert status.state == SandboxState.RUNNING


def _sh(h: NodeHarness, sandbox_id: str, cmd: str) -> str:
    """Run ``cmd`` as root in the sandbox; its stdout, stripped (exit 0 asserted)."""
    out, code = h.run(_run(h.node, sandbox_id, ExecRequest(cmd=cmd, user="root")))
    assert code == 0, out
    return out.strip()


def _start_counter(h: NodeHarness, sandbox_id: str) -> None:
    h.run(h.node.exec(sandbox_id, ExecRequest(cmd=_COUNTER, background=True)))
    deadline = time.monotonic() + 30
    while _sh(h, sandbox_id, "cat /tmp/c 2>/dev/null || echo 0") in ("", "0"):
        assert time.monotonic() < deadline, "the counter did not start"


def _write(h: NodeHarness, sandbox_id: str, path: str, data: bytes) -> None:
    h.run(h.node.write_file(sandbox_id, path, _one(data)))


def _state(h: NodeHarness, sandbox_id: str) -> SandboxState:
    return h.run(h.node.get_sandbox(sandbox_id)).state


def _volume(h: NodeHarness, sandbox_id: str) -> Path:
    return h.node.pool.sandbox_path(sandbox_id)


def test_hibernate_frees_the_vm_and_a_guest_call_wakes_it_with_processes_running(
    node: NodeHarness,
) -> None:
    _create(node, "hib")
    _start_counter(node, "hib")
    _write(node, "hib", "/home/user/kept.txt", b"before hibernate")
    before = _counter(node, "hib")

    status = node.run(node.node.hibernate_sandbox("hib"))

    assert status.state == SandboxState.HIBERNATED and status.vmm_pid is None
    assert qemu_pids(node.config.data_dir) == []
    assert (_volume(node, "hib") / "vmstate").stat().st_size > 0
    assert node.run(node.node.hibernate_sandbox("hib")).state == SandboxState.HIBERNATED
    time.sleep(3.0)  # the host's clock runs on; the guest's must catch up on waking
    after = _counter(node, "hib")  # any guest call wakes it
    assert _state(node, "hib") == SandboxState.RUNNING
    # Carried on, did not restart, and did not run while hibernated (those 3 s are 30
    # ticks). The ticks it made are the guest's time until it stopped and from its wake
    # to the exec: up to 0.6 s seen in a busy run (after a restore TCG translates the
    # guest's code anew), so the bound is 1.5 s.
    assert before <= after < before + 15, (before, after)
    assert node.run(_read(node.node, "hib", "/home/user/kept.txt")) == b"before hibernate"
    assert abs(_guest_clock_offset_s(node, "hib")) < 1.0
    time.sleep(0.5)
    assert _counter(node, "hib") > after  # still counting
    assert not (_volume(node, "hib") / "vmstate").exists()


def test_pause_resume_hibernate_resume_cycles_keep_every_file(node: NodeHarness) -> None:
    _create(node, "cycles")
    cycles = 100
    for i in range(cycles):
        _write(node, "cycles", f"/home/user/f{i}", f"cycle {i}".encode())
        node.run(node.node.pause_sandbox("cycles"))
        node.run(node.node.resume_sandbox("cycles"))
        node.run(node.node.hibernate_sandbox("cycles"))
        assert node.run(node.node.resume_sandbox("cycles")).state == SandboxState.RUNNING
    listing = _sh(node, "cycles", "cd /home/user && for f in f*; do echo $f $(cat $f); done")
    assert sorted(listing.splitlines()) == sorted(f"f{i} cycle {i}" for i in range(cycles))


def test_resume_from_pause_sets_the_guest_clock(node: NodeHarness) -> None:
    _create(node, "clock")
    node.run(node.node.pause_sandbox("clock"))
    time.sleep(2.0)
    node.run(node.node.resume_sandbox("clock"))
    assert abs(_guest_clock_offset_s(node, "clock")) < 1.0


def test_restore_rolls_back_files_and_running_processes(node: NodeHarness) -> None:
    _create(node, "rb")
    _start_counter(node, "rb")
    _write(node, "rb", "/home/user/doc.txt", b"version 1")
    snap = node.run(node.node.snapshot_sandbox("rb", "rb-s1"))
    at_snapshot = _counter(node, "rb")
    assert snap.sandbox_id == "rb" and snap.parent_id is None
    assert _state(node, "rb") == SandboxState.RUNNING

    _write(node, "rb", "/home/user/doc.txt", b"version 2")
    _write(node, "rb", "/home/user/new.txt", b"after the snapshot")
    _sh(node, "rb", "pkill -f 'while true' || true")
    old_machine_id = _sh(node, "rb", "cat /etc/machine-id")

    status = node.run(node.node.restore_sandbox("rb", "rb-s1"))

    assert status.state == SandboxState.RUNNING and status.head_snapshot == "rb-s1"
    assert node.run(_read(node.node, "rb", "/home/user/doc.txt")) == b"version 1"
    assert "new.txt" not in _sh(node, "rb", "ls /home/user")
    first = _counter(node, "rb")
    assert at_snapshot - 2 <= first <= at_snapshot + 10, (at_snapshot, first)
    time.sleep(0.5)
    assert _counter(node, "rb") > first  # the killed counter runs again
    assert _sh(node, "rb", "cat /etc/machine-id") != old_machine_id
    assert abs(_guest_clock_offset_s(node, "rb")) < 1.0


def test_fork_of_a_live_sandbox_gives_independent_children(node: NodeHarness) -> None:
    _create(node, "parent")
    _write(node, "parent", "/home/user/shared.txt", b"from the parent")

    children = node.run(node.node.fork_sandbox("parent", ["kid-a", "kid-b"]))

    assert [c.state for c in children] == [SandboxState.RUNNING] * 2
    assert _state(node, "parent") == SandboxState.RUNNING
    for sid in ("parent", "kid-a", "kid-b"):
        assert node.run(_read(node.node, sid, "/home/user/shared.txt")) == b"from the parent"
        _write(node, sid, f"/home/user/only-{sid}.txt", sid.encode())
    for sid in ("parent", "kid-a", "kid-b"):
        own = sorted(_sh(node, sid, "ls /home/user").split())
        assert own == sorted(["shared.txt", f"only-{sid}.txt"]), (sid, own)
    names = {sid: _sh(node, sid, "hostname") for sid in ("parent", "kid-a", "kid-b")}
    assert names == {"parent": "parent", "kid-a": "kid-a", "kid-b": "kid-b"}
    assert _sh(node, "kid-a", "getent hosts kid-a").split() == ["127.0.1.1", "kid-a"]
    ids = {_sh(node, sid, "cat /etc/machine-id") for sid in ("parent", "kid-a", "kid-b")}
    assert len(ids) == 3


def test_sandboxes_created_from_one_snapshot_draw_different_random_bytes(
    node: NodeHarness,
) -> None:
    _create(node, "seed")
    snap = node.run(node.node.snapshot_sandbox("seed", "seed-s"))
    spec = {k: getattr(snap, k) for k in ("template", "cpus", "memory_mib", "disk_mib")}
    for sid in ("twin-1", "twin-2"):
        _create(node, sid, from_snapshot="seed-s", **spec)
    draws = {
        sid: _sh(node, sid, "head -c 32 /dev/urandom | od -An -tx1")
        for sid in ("twin-1", "twin-2", "seed")
    }
    assert len(set(draws.values())) == 3, draws
    assert node.run(node.node.get_sandbox("twin-1")).head_snapshot == "seed-s"


def test_snapshot_tree_delete_reparents_and_an_untouched_snapshot_holds_little(
    node: NodeHarness,
) -> None:
    _create(node, "tree")
    node.run(node.node.hibernate_sandbox("tree"))  # untouched from here on
    s1 = node.run(node.node.snapshot_sandbox("tree", "t1"))
    s2 = node.run(node.node.snapshot_sandbox("tree", "t2"))
    assert (s1.parent_id, s2.parent_id) == (None, "t1")
    assert _state(node, "tree") == SandboxState.HIBERNATED
    measured = node.run(node.node.get_snapshot("t2"))
    assert measured.exclusive_bytes is not None and measured.exclusive_bytes <= 1 << 20
    assert measured.memory_bytes > 0

    node.run(node.node.delete_snapshot("t1"))
    node.run(node.node.delete_snapshot("t1"))  # idempotent

    listed = {s.snapshot_id: s.parent_id for s in node.run(node.node.list_snapshots())}
    assert listed == {"t2": None}
    with pytest.raises(NotFound):
        node.run(node.node.get_snapshot("t1"))
    assert node.run(node.node.snapshot_sandbox("tree", "t2")).snapshot_id == "t2"  # idempotent


def test_negative_lifecycle_calls_that_do_not_fit_change_nothing(node: NodeHarness) -> None:
    _create(node, "neg")
    node.run(node.node.snapshot_sandbox("neg", "neg-s"))
    with pytest.raises(InvalidArgument):
        node.run(
            node.node.create_sandbox(SandboxSpec("other", memory_mib=512, from_snapshot="neg-s"))
        )
    with pytest.raises(NotFound):
        node.run(node.node.restore_sandbox("neg", "no-such-snapshot"))
    with pytest.raises(Conflict):
        node.run(node.node.fork_sandbox("neg", ["neg"]))
    with pytest.raises(InvalidArgument):
        node.run(node.node.fork_sandbox("neg", []))
    node.run(node.node.pause_sandbox("neg"))
    node.run(node.node.hibernate_sandbox("neg"))
    with pytest.raises(Conflict, match="hibernated"):
        node.run(node.node.pause_sandbox("neg"))
    assert _state(node, "neg") == SandboxState.HIBERNATED
    assert {s.sandbox_id for s in node.run(node.node.list_sandboxes())} == {"neg"}


def test_a_restarted_node_keeps_hibernated_sandboxes_and_snapshots(node: NodeHarness) -> None:
    _create(node, "keep")
    _write(node, "keep", "/home/user/a.txt", b"kept")
    node.run(node.node.snapshot_sandbox("keep", "keep-s"))
    node.run(node.node.hibernate_sandbox("keep"))

    node.restart()

    assert _state(node, "keep") == SandboxState.HIBERNATED
    assert [s.snapshot_id for s in node.run(node.node.list_snapshots())] == ["keep-s"]
    assert node.run(_read(node.node, "keep", "/home/user/a.txt")) == b"kept"
