"""The VMM jail's parts that need no VM: its seccomp program, cgroups, uids.

The seccomp program is run here by a small classic-BPF interpreter over the
``seccomp_data`` the kernel would give it, so each verdict is checked, not its text.
The cgroup code is run against a fake cgroup mount of each layout (v1 as on these
machines, and v2, which these machines do not mount with controllers).
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from space.node.privileged import _jail_exec as jail_exec
from space.node.privileged import _jails as jails
from space.node.privileged.cgroups import CgroupLimits, VmCgroups
from space.node.vmm.jail import JAIL_UIDS

ALLOW, KILL = jail_exec.SECCOMP_RET_ALLOW, jail_exec.SECCOMP_RET_KILL_PROCESS
EPERM = jail_exec.SECCOMP_RET_ERRNO | 1
ENOSYS = jail_exec.SECCOMP_RET_ERRNO | 38
THREAD_FLAGS = 0x3D0F00  # what glibc's pthread_create passes to clone


def verdict(nr: int, arg0: int = 0, arch: int = jail_exec.AUDIT_ARCH_X86_64) -> int:
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    program, pc = jail_exec.seccomp_program(), 0
    accumulator = 0
    while True:
        code, jt, jf, k = program[pc]
        if code == 0x20:  # ld [k]
            accumulator = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:  # ret k
            return k
        else:
            taken = {0x15: accumulator == k, 0x35: accumulator >= k, 0x45: bool(accumulator & k)}
            pc += jt if taken[code] else jf
        pc += 1


@pytest.mark.parametrize("name", sorted(jail_exec.DENIED_SYSCALLS))
def test_negative_every_call_a_vmm_never_needs_fails_with_eperm(name: str) -> None:
    assert verdict(jail_exec.DENIED_SYSCALLS[name]) == EPERM


@pytest.mark.parametrize("nr", [0, 1, 9, 16, 257, 232, 202, 234])  # read write mmap ioctl ...
def test_what_qemu_runs_on_is_allowed(nr: int) -> None:
    assert verdict(nr) == ALLOW


def test_threads_are_allowed_and_a_clone_into_a_namespace_is_not() -> None:
    assert verdict(jail_exec.SYS_CLONE, THREAD_FLAGS) == ALLOW
    assert verdict(jail_exec.SYS_CLONE3) == ENOSYS  # glibc falls back to clone
    for flag in (0x10000000, 0x20000000, 0x40000000, 0x00020000):  # user pid net mount
        assert verdict(jail_exec.SYS_CLONE, THREAD_FLAGS | flag) == EPERM


def test_negative_another_architecture_or_the_x32_abi_kills() -> None:
    assert verdict(0, arch=0x40000003) == KILL  # i386
    assert verdict(jail_exec.X32_SYSCALL_BIT | 0) == KILL


def test_the_program_fits_classic_bpf() -> None:
    program = jail_exec.seccomp_program()
    assert len(program) < 4096
    assert all(0 <= jt < 256 and 0 <= jf < 256 for _, jt, jf, _ in program)


def _fake_v1(root: Path) -> Path:
    for controller in ("memory", "cpu", "pids", "blkio"):
        (root / controller).mkdir(parents=True)
    own = root / "self-cgroup"
    own.write_text(
        "9:pids:/\n8:blkio:/\n4:memory:/job/42\n1:cpu,cpuacct:/\n0::/\n",
    )
    return own


def fake_cgroup_fs(monkeypatch: pytest.MonkeyPatch, files: list[str]) -> None:
    """Like a cgroup mount: a new directory has the kernel's files, and rmdir takes
    a directory with only those (and an empty cgroup.procs)."""
    real_mkdir, real_rmdir = Path.mkdir, Path.rmdir

    def mkdir(path: Path, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        existed = path.exists()
        real_mkdir(path, mode, parents, exist_ok)
        if not existed:
            for name in ["cgroup.procs", *files]:
                (path / name).touch()

    def rmdir(path: Path) -> None:
        procs = path / "cgroup.procs"
        if procs.exists() and procs.read_text().strip():
            raise OSError(16, "Device or resource busy")
        for child in path.iterdir():
            if child.is_file():
                child.unlink()
        real_rmdir(path)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(Path, "rmdir", rmdir)


def test_v1_limits_are_written_per_controller_under_the_nodes_own_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = _fake_v1(tmp_path)
    files = ["memory.limit_in_bytes", "cpu.cfs_period_us", "cpu.cfs_quota_us", "pids.max"]
    fake_cgroup_fs(monkeypatch, [*files, "blkio.bfq.weight"])
    cgroups = VmCgroups("node1", root=tmp_path, own=own)
    assert not cgroups.unified
    procs = cgroups.create("sb-1", CgroupLimits(memory_bytes=512 << 20, cpus=2, pids=128))
    memory = tmp_path / "memory/job/42/space/node1/sb-1"
    assert memory / "cgroup.procs" in procs and len(procs) == 4
    assert (memory / "memory.limit_in_bytes").read_text() == str(512 << 20)
    cpu = tmp_path / "cpu/space/node1/sb-1"
    assert (cpu / "cpu.cfs_quota_us").read_text() == "200000"
    assert (cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert (tmp_path / "pids/space/node1/sb-1/pids.max").read_text() == "128"
    assert (tmp_path / "blkio/space/node1/sb-1/blkio.bfq.weight").read_text() == "100"
    assert not (tmp_path / "blkio/space/node1/sb-1/blkio.weight").exists()


def test_v2_limits_and_delegation_sit_beside_the_nodes_own_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    own = tmp_path / "self-cgroup"
    own.write_text("0::/system.slice/space.service\n")
    limit_files = ["memory.max", "memory.swap.max", "cpu.max", "pids.max", "io.weight"]
    fake_cgroup_fs(monkeypatch, limit_files)
    for d in ("system.slice", "system.slice/space", "system.slice/space/node1"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        (tmp_path / d / "cgroup.controllers").write_text("cpu io memory pids\n")
    cgroups = VmCgroups("node1", root=tmp_path, own=own)
    assert cgroups.unified
    (procs,) = cgroups.create("sb-1", CgroupLimits(memory_bytes=1 << 30, cpus=1, pids=64))
    group = tmp_path / "system.slice/space/node1/sb-1"
    assert procs == group / "cgroup.procs"
    assert (group / "memory.max").read_text() == str(1 << 30)
    assert (group / "memory.swap.max").read_text() == "0"
    assert (group / "cpu.max").read_text() == "100000 100000"
    assert (group / "pids.max").read_text() == "64"
    assert (group / "io.weight").read_text() == "default 100"
    for d in ("", "system.slice", "system.slice/space", "system.slice/space/node1"):
        assert (tmp_path / d / "cgroup.subtree_control").read_text() == "+memory +cpu +pids +io"


def test_removal_and_sweep_leave_no_cgroup_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = _fake_v1(tmp_path)
    fake_cgroup_fs(monkeypatch, [])
    cgroups = VmCgroups("node1", root=tmp_path, own=own)
    limits = CgroupLimits(memory_bytes=1 << 28, cpus=1, pids=64)
    cgroups.create("gone", limits)
    for procs in cgroups.create("live", limits):
        procs.write_text("4242\n")  # a VMM still runs in it
    cgroups.sweep()
    assert not (tmp_path / "pids/space/node1/gone").exists()
    assert (tmp_path / "pids/space/node1/live").exists()
    cgroups.remove_bases()
    assert (tmp_path / "pids/space/node1").exists()  # a VMM is left: kept, no error
    for procs in cgroups.create("live", limits):
        procs.write_text("")  # it exited
    cgroups.remove("live")
    cgroups.remove_bases()
    assert not (tmp_path / "pids/space").exists()
    assert not (tmp_path / "memory/job/42/space").exists()


def test_a_jail_uid_is_never_one_a_live_process_or_a_launch_in_flight_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = JAIL_UIDS[0]
    monkeypatch.setattr(jails, "jailed_uid_in_use", lambda: {first, first + 2})
    monkeypatch.setattr(jails, "_launching", set())
    assert jails.take_uid() == first + 1
    assert jails.take_uid() == first + 3  # first + 1 is being launched
