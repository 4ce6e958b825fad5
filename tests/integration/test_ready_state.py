"""A template's ready state: sandboxes of its shape start from a booted VM's memory.

The node makes it once per template digest at start (one boot, kept in the pool); each
sandbox is then a copy-on-write clone of it, woken with a fresh identity.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from space.node.api import SandboxSpec, SandboxState
from space.node.vmm.qemu import TCG_CPU, guest_cpu

from .conftest import NodeHarness
from .test_lifecycle import _sh

pytestmark = pytest.mark.vm


def _field(path: Path, key: str) -> str:
    """One field of ``btrfs subvolume show``: ``UUID`` or ``Parent UUID``."""
    show = subprocess.run(
        ["btrfs", "subvolume", "show", str(path)], check=True, capture_output=True, text=True
    ).stdout
    for line in show.splitlines():
        name, _, value = line.strip().partition(":")
        if name == key:
            return value.strip()
    raise AssertionError(f"no {key} in {show}")


def test_sandboxes_of_the_ready_shape_start_from_the_ready_state_each_its_own(
    node: NodeHarness,
) -> None:
    template = node.node.templates.catalog.resolve("base")
    assert template.ready is not None and template.ready_mark.is_file()
    for sid in ("warm-1", "warm-2"):
        status = node.run(node.node.create_sandbox(SandboxSpec(sid, memory_mib=256)))
        assert status.state == SandboxState.RUNNING
        assert _field(node.node.pool.sandbox_path(sid), "Parent UUID") == _field(
            template.ready, "UUID"
        )
    assert [_sh(node, sid, "hostname") for sid in ("warm-1", "warm-2")] == ["warm-1", "warm-2"]
    draws = {
        _sh(node, sid, "head -c 32 /dev/urandom | od -An -tx1") for sid in ("warm-1", "warm-2")
    }
    ids = {_sh(node, sid, "cat /etc/machine-id") for sid in ("warm-1", "warm-2")}
    assert len(draws) == 2 and len(ids) == 2
    _sh(node, "warm-1", "echo mine > /home/user/f")
    assert _sh(node, "warm-2", "ls /home/user") == ""  # clones share nothing written


def test_another_shape_boots_from_the_template_itself(node: NodeHarness) -> None:
    template = node.node.templates.catalog.resolve("base")
    node.run(node.node.create_sandbox(SandboxSpec("big-disk", disk_mib=3072)))
    assert _field(node.node.pool.sandbox_path("big-disk"), "Parent UUID") == _field(
        template.volume.path, "UUID"
    )
    assert _sh(node, "big-disk", "hostname") == "big-disk"


def test_a_restarted_node_reuses_the_ready_state(node: NodeHarness) -> None:
    ready = node.node.templates.catalog.resolve("base").ready
    assert ready is not None
    before = _field(ready, "UUID")
    node.restart()
    after = node.node.templates.catalog.resolve("base").ready
    assert after is not None and _field(after, "UUID") == before


def test_a_ready_state_booted_on_another_cpu_is_made_again_at_start(node: NodeHarness) -> None:
    """A ready state an earlier version booted with ``-cpu max`` (its mark says only
    "ready") is made again on the CPU VMs get now: its sandboxes' kernels then copy
    memory without ``rep movsb``, which TCG emulates a byte at a time."""
    template = node.node.templates.catalog.resolve("base")
    assert template.ready is not None
    cpu = guest_cpu(node.node.accelerator)
    assert template.ready_mark.read_text() == f"ready cpu={cpu}\n"
    before = _field(template.ready, "UUID")
    template.ready_mark.write_text("ready\n")
    node.restart()
    after = node.node.templates.catalog.resolve("base")
    assert after.ready is not None and _field(after.ready, "UUID") != before
    assert after.ready_mark.read_text() == f"ready cpu={cpu}\n"
    node.run(node.node.create_sandbox(SandboxSpec("no-fast-strings", memory_mib=256)))
    flags = _sh(node, "no-fast-strings", "grep -m1 '^flags' /proc/cpuinfo").split()
    assert "sse2" in flags
    if cpu == TCG_CPU:
        assert "erms" not in flags and "fsrm" not in flags


def test_gvisor_sandboxes_of_the_ready_shape_restore_the_gvisor_ready_state(
    node: NodeHarness,
) -> None:
    """Where the node offers gVisor, the template has a gVisor ready state too: each
    gVisor sandbox of its shape is a clone of it restored with a fresh identity; one
    of another shape boots on the template's tree. A restarted node reuses it."""
    template = node.node.templates.catalog.resolve("base")
    assert template.gvisor_ready is not None and template.gvisor_ready_mark.is_file()
    for sid in ("gv-warm-1", "gv-warm-2"):
        spec = SandboxSpec(sid, memory_mib=256, guest="gvisor")
        assert node.run(node.node.create_sandbox(spec)).state == SandboxState.RUNNING
        assert _field(node.node.pool.sandbox_path(sid), "Parent UUID") == _field(
            template.gvisor_ready, "UUID"
        )
    sids = ("gv-warm-1", "gv-warm-2")
    assert [_sh(node, sid, "hostname") for sid in sids] == list(sids)
    assert len({_sh(node, sid, "cat /etc/machine-id") for sid in sids}) == 2
    _sh(node, "gv-warm-1", "echo mine > /home/user/f")
    assert _sh(node, "gv-warm-2", "ls /home/user") == ""  # clones share nothing written

    node.run(node.node.create_sandbox(SandboxSpec("gv-big", disk_mib=3072, guest="gvisor")))
    tree = node.config.data_dir / "pool" / "gvisor" / template.digest
    assert _field(node.node.pool.sandbox_path("gv-big"), "Parent UUID") == _field(tree, "UUID")

    before = _field(template.gvisor_ready, "UUID")
    node.restart()
    after = node.node.templates.catalog.resolve("base").gvisor_ready
    assert after is not None and _field(after, "UUID") == before
