"""Per-sandbox metrics from a real guest: spaced's /proc and statvfs figures match the
sandbox's shape, a busy guest shows CPU use, and a paused sandbox is not woken for them."""

from __future__ import annotations

import time

import pytest

from space.node.api import METRICS_INTERVAL_S, ExecRequest, SandboxSpec, SandboxState

from .conftest import NodeHarness

pytestmark = pytest.mark.vm

MIB = 1024 * 1024


def test_a_real_guest_reports_its_vcpus_memory_and_disk_and_a_paused_one_is_not_woken(
    node: NodeHarness,
) -> None:
    sid = "it-metrics"
    spec = SandboxSpec(sid, cpus=2, memory_mib=320, disk_mib=2048)
    node.run(node.node.create_sandbox(spec))

    (first,) = node.run(node.node.sandbox_metrics(sid))
    assert first.cpu_count == 2
    # The guest kernel keeps some of its RAM to itself (MemTotal < what QEMU gives it).
    assert 0.75 * spec.memory_mib * MIB < first.mem_total <= spec.memory_mib * MIB
    assert 0 < first.mem_used < first.mem_total
    assert 0 < first.disk_used < first.disk_total <= spec.disk_mib * MIB
    assert 0 <= first.cpu_used_pct <= 100

    busy = node.run(
        node.node.exec(sid, ExecRequest(argv=["sh", "-c", "while :; do :; done"], background=True))
    )
    node.run(busy.aclose())
    time.sleep(METRICS_INTERVAL_S)
    second = node.run(node.node.sandbox_metrics(sid))[-1]
    assert second.timestamp > first.timestamp
    assert second.cpu_used_pct > 20  # one of two vCPUs spinning: about 50 %

    node.run(node.node.pause_sandbox(sid))
    time.sleep(METRICS_INTERVAL_S)
    kept = node.run(node.node.sandbox_metrics(sid))
    assert kept[-1] == second and len(kept) == 2
    assert node.run(node.node.get_sandbox(sid)).state == SandboxState.PAUSED
