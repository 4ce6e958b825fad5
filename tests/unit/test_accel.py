"""Accelerator choice: KVM only where a stock guest kernel really runs under it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.node.vmm.accel import HostFacts, choose_accelerator, host_facts, probe_kvm_boot
from tests.root_broker import root_broker


class _Probe:
    def __init__(self, result: bool) -> None:
        self.result = result
        self.calls = 0

    async def __call__(self) -> bool:
        self.calls += 1
        return self.result


def _choose(mode: str, facts: HostFacts, probe: _Probe, cache: Path | None = None) -> str:
    return asyncio.run(
        choose_accelerator(
            mode,  # type: ignore[arg-type]
            facts=facts,
            probe=probe,
            cache_file=cache,
            kernel_digest="k1",
        )
    )


PLAIN_KVM = HostFacts(kvm_device=True, pvm_host=False, release="6.1.0")


def test_auto_without_dev_kvm_is_tcg_and_never_probes() -> None:
    probe = _Probe(True)
    assert _choose("auto", HostFacts(False, False, "6.1.0"), probe) == "tcg"
    assert probe.calls == 0


def test_auto_on_a_pvm_host_is_tcg_and_never_probes() -> None:
    probe = _Probe(True)
    assert _choose("auto", HostFacts(True, True, "6.1.0"), probe) == "tcg"
    assert probe.calls == 0


def test_auto_with_kvm_uses_kvm_when_the_probe_boot_succeeds() -> None:
    assert _choose("auto", PLAIN_KVM, _Probe(True)) == "kvm"


def test_negative_auto_with_kvm_falls_back_to_tcg_when_the_probe_boot_fails() -> None:
    assert _choose("auto", PLAIN_KVM, _Probe(False)) == "tcg"


@pytest.mark.parametrize("mode", ["kvm", "tcg"])
def test_forced_modes_are_used_as_given_without_probing(mode: str) -> None:
    probe = _Probe(False)
    assert _choose(mode, HostFacts(False, True, "6.1.0"), probe) == mode
    assert probe.calls == 0


def test_probe_result_is_cached_per_kernel_and_host_release(tmp_path: Path) -> None:
    cache = tmp_path / "accel.json"
    first = _Probe(True)
    assert _choose("auto", PLAIN_KVM, first, cache) == "kvm"
    again = _Probe(False)
    assert _choose("auto", PLAIN_KVM, again, cache) == "kvm"
    assert (first.calls, again.calls) == (1, 0)
    other_host = HostFacts(True, False, "6.2.0")
    assert _choose("auto", other_host, again, cache) == "tcg"
    assert again.calls == 1


def test_negative_a_corrupt_cache_file_means_probing_again(tmp_path: Path) -> None:
    cache = tmp_path / "accel.json"
    cache.write_text("{not json")
    probe = _Probe(True)
    assert _choose("auto", PLAIN_KVM, probe, cache) == "kvm"
    assert probe.calls == 1


def test_host_facts_see_pvm_in_proc_modules(tmp_path: Path) -> None:
    modules = tmp_path / "modules"
    modules.write_text("kvm_pvm 16384 0 - Live 0x0\nkvm 1200 1 kvm_pvm, Live 0x0\n")
    facts = host_facts(dev_kvm=tmp_path / "kvm", proc_modules=modules, sys_module=tmp_path)
    assert facts == HostFacts(kvm_device=False, pvm_host=True, release=facts.release)


def test_host_facts_see_pvm_in_sys_module_when_proc_modules_is_missing(tmp_path: Path) -> None:
    (tmp_path / "kvm_pvm").mkdir()
    (tmp_path / "kvm").touch()
    facts = host_facts(
        dev_kvm=tmp_path / "kvm", proc_modules=tmp_path / "missing", sys_module=tmp_path
    )
    assert facts.kvm_device and facts.pvm_host


def test_host_facts_without_pvm_module_report_a_plain_host(tmp_path: Path) -> None:
    modules = tmp_path / "modules"
    modules.write_text("kvm_intel 1 0 - Live 0x0\nkvm 1 1 kvm_intel, Live 0x0\n")
    facts = host_facts(dev_kvm=tmp_path / "kvm", proc_modules=modules, sys_module=tmp_path)
    assert not facts.pvm_host


#: A hung VMM, its argv kept (the broker signals a VMM whose argv names its run dir).
_HANG = "while :; do sleep 1; done\n"


@pytest.fixture
def jailed(tmp_path: Path) -> Iterator[Path]:
    """The run root of a node whose broker runs (the probe runs jailed), with the
    kernel and initrd files the probe binds."""
    for name in ("k", "i"):
        (tmp_path / name).write_bytes(b"")
    with root_broker(tmp_path):
        yield tmp_path / "run"
    assert not (tmp_path / "run" / "accel-probe").exists()


def _fake_qemu(tmp_path: Path, script: str) -> str:
    fake = tmp_path / "fake-qemu"
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    return str(fake)


def _probe(fake: str, tmp_path: Path, run_root: Path, timeout_s: float) -> bool:
    return asyncio.run(
        probe_kvm_boot(fake, tmp_path / "k", tmp_path / "i", run_root=run_root, timeout_s=timeout_s)
    )


def test_negative_probe_boot_of_a_hanging_vmm_is_killed_at_its_deadline(
    tmp_path: Path, jailed: Path
) -> None:
    # A fake "qemu" that never prints the initramfs marker stands in for a hung guest.
    fake = _fake_qemu(tmp_path, "echo 'Linux version 6.1'\n" + _HANG)
    start = time.monotonic()
    assert not _probe(fake, tmp_path, jailed, 0.5)
    assert time.monotonic() - start < 5
    assert not _processes_running(fake)


def test_probe_boot_succeeds_once_the_kernel_runs_init_in_a_jail_that_can_open_kvm(
    tmp_path: Path, jailed: Path
) -> None:
    """The probe QEMU runs as a jailed VM does: a jail uid, and /dev/kvm a node of the
    jail's own it can open, whatever the host's node allows (here 0600 root)."""
    fake = _fake_qemu(
        tmp_path,
        '[ "$(id -u)" -ge 1500000000 ] || exit 1\n'
        "exec 3<>/dev/kvm || exit 1\n"
        "echo 'Freeing unused kernel image'\necho 'Run /init as init process'\n" + _HANG,
    )
    assert _probe(fake, tmp_path, jailed, 10)
    assert not _processes_running(fake)


def test_negative_probe_boot_with_a_missing_qemu_binary_fails_fast(
    tmp_path: Path, jailed: Path
) -> None:
    start = time.monotonic()
    assert not _probe(str(tmp_path / "nope"), tmp_path, jailed, 5)
    assert time.monotonic() - start < 5


def _processes_running(program: str) -> bool:
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and program.encode() in (entry / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False
