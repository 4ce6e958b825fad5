"""Assume QEMU is compromised: what can a jailed VMM reach?

Two real QEMUs are started the way the node starts them (``QemuVM.launch``: jailed),
A and B, each with its own kernel, initrd, disk (A's encrypted, as a node's are) and RAM
file, beside a data dir holding a master key, a node token and a database. Then:

- over A's own QMP, A is asked to open host files (``blockdev-add``) and read them
  (``human-monitor-command`` with ``qemu-io``): B's disk and RAM file, the data dir's
  files, ``/etc/shadow``. Each fails; the same request for A's own kernel succeeds;
- a probe runs with A's exact uid, namespaces, cgroups and the jail's seccomp filter
  (``jail_probe.py``) and tries to write under /etc, signal and ptrace, load a module,
  mount, reach a TCP listener on the host's loopback, B's QMP socket and an abstract
  socket, exceed its memory and fork-bomb. Each fails (the memory hog is killed by the
  cgroup, the fork bomb stops at the pids limit) while B runs on; reading its own disk
  and writing in its own run directory succeed;
- A's disk passphrase is in no process's argv or environment and in no file the host
  sees: A's QEMU holds it (it opens its disk again with it), B's has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from qemu.qmp import ExecuteError, QMPClient

from space.node.core.keys import NodeKeys
from space.node.images import GuestImage, build_template
from space.node.privileged import Scope, start_broker
from space.node.storage.disks import encrypt_image
from space.node.vmm.jail import JAIL_UIDS, jail_for
from space.node.vmm.qemu import QemuVM, VmConfig

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]

PROBE = Path(__file__).with_name("jail_probe.py")
SECRET = b"SPACE-SECRET-DO-NOT-LEAK"


KEYS = NodeKeys.from_node_key(os.urandom(32))


@pytest.fixture(scope="module")
def image() -> GuestImage:
    return build_template("base", progress=lambda line: None)


@pytest.fixture(scope="module")
def encrypted_rootfs(image: GuestImage) -> Iterator[Path]:
    """The image's disk as the node imports it: LUKS under ``KEYS``."""
    directory = Path(tempfile.mkdtemp(prefix="space-jail-disk-"))
    try:
        asyncio.run(encrypt_image(image.rootfs, directory / "rootfs", KEYS.disk_passphrase))
        yield directory / "rootfs"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _vm_files(image: GuestImage, rootfs: Path, directory: Path) -> VmConfig:
    directory.mkdir(mode=0o700)
    for name, source in (("kernel", image.kernel), ("initrd", image.initrd)):
        shutil.copyfile(source, directory / name)
    subprocess.run(
        ["cp", "--reflink=auto", "--sparse=always", str(rootfs), str(directory / "disk")],
        check=True,
    )
    with open(directory / "memory.ram", "wb") as ram:
        ram.write(SECRET)
        ram.truncate(256 << 20)  # QEMU takes a RAM file of the guest's size or none
    return VmConfig(
        sandbox_id=directory.name,
        run_dir=Path(),  # set by the caller
        kernel=directory / "kernel",
        initrd=directory / "initrd",
        rootfs=directory / "disk",
        kernel_cmdline=image.kernel_cmdline,
        console_log=directory / "console.log",
        memory_file=directory / "memory.ram",
        memory_shared=True,
        incoming=True,  # QEMU runs, waiting for a state: no guest CPU spent
        keys=KEYS,
    )


@dataclass
class TwoVMs:
    """A and B running jailed, the directory of every file the test made, and the
    event loop the VMs are watched on."""

    runner: asyncio.Runner
    a: QemuVM
    b: QemuVM
    work: Path


@pytest.fixture
def two_vms(image: GuestImage, encrypted_rootfs: Path) -> Iterator[TwoVMs]:
    work = Path(tempfile.mkdtemp(prefix="space-jail-"))
    run_root = Path(tempfile.mkdtemp(prefix="sj-", dir="/run"))
    data = work / "data"
    data.mkdir(mode=0o700)
    for name in ("master.key", "node-token", "space.db"):
        (data / name).write_bytes(SECRET)
    vms: list[QemuVM] = []
    with asyncio.Runner() as runner:
        broker = runner.run(start_broker(Scope(run_root, (work, run_root))))
        try:
            # A's disk is encrypted as a node's are; B's raw (as a tool's may be).
            for name, rootfs in (("a", encrypted_rootfs), ("b", image.rootfs)):
                cfg = replace(_vm_files(image, rootfs, work / name), run_dir=run_root / name)
                vms.append(runner.run(QemuVM.launch(cfg)))
            yield TwoVMs(runner, vms[0], vms[1], work)
        finally:
            for vm in vms:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(vm.pid, signal.SIGKILL)  # whatever the test did to the QemuVM
                runner.run(vm.kill())
            jail_for(run_root).close()
            runner.run(broker.close())
            shutil.rmtree(run_root, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
    assert not any(vm.alive for vm in vms)


async def _qmp(vm: QemuVM) -> QMPClient:
    await vm.disconnect_qmp()  # QEMU's QMP serves one client at a time
    client = QMPClient("attacker")
    await client.connect(str(vm.config.qmp_socket))
    return client


def test_negative_a_jailed_qemu_opens_no_host_file_over_its_own_qmp(two_vms: TwoVMs) -> None:
    two_vms.runner.run(_ask_qemu_for_host_files(two_vms.a, two_vms.b, two_vms.work))
    assert two_vms.a.alive and two_vms.b.alive


async def _ask_qemu_for_host_files(a: QemuVM, b: QemuVM, work: Path) -> None:
    forbidden = [
        b.config.rootfs,
        b.config.memory_file,
        work / "data" / "master.key",
        work / "data" / "node-token",
        work / "data" / "space.db",
        Path("/etc/shadow"),
    ]
    qmp = await _qmp(a)
    try:
        for i, path in enumerate(forbidden):
            args = {"driver": "file", "filename": str(path), "node-name": f"x{i}"}
            with pytest.raises(ExecuteError, match="No such file or directory"):
                await qmp.execute("blockdev-add", {**args, "read-only": True})
            out = await qmp.execute(
                "human-monitor-command", {"command-line": f'qemu-io x{i} "read -v 0 16"'}
            )
            assert "Cannot find" in str(out)
        # The control: the same requests for a file of A's own are answered.
        own = {"driver": "file", "filename": str(a.config.kernel), "node-name": "own"}
        await qmp.execute("blockdev-add", {**own, "read-only": True})
        await qmp.execute("human-monitor-command", {"command-line": 'qemu-io own "read -v 0 16"'})
    finally:
        await qmp.disconnect()
    # qemu-io writes what it read to QEMU's stdout: A's kernel only (a bzImage's "MZ").
    output = a.config.stderr_log.read_text()
    assert output.count("read 16/16 bytes") == 1 and "MZ" in output
    assert SECRET[:4].hex(" ") not in output


def test_the_disk_key_is_in_its_own_jail_only(two_vms: TwoVMs) -> None:
    a, b = two_vms.a, two_vms.b
    passphrase = KEYS.disk_passphrase
    assert a.config.disk_format == "luks" and b.config.disk_format == "raw"
    # In no process's argv or environment, and in no file the host can see.
    for proc in Path("/proc").iterdir():
        for name in ("cmdline", "environ"):
            with contextlib.suppress(OSError):
                assert passphrase not in (proc / name).read_bytes(), (proc.name, name)
    for directory in (two_vms.work, a.config.run_dir.parent, Path("/run/space-jail")):
        for path in directory.rglob("*"):
            if path.is_file() and not path.is_socket():
                assert passphrase not in path.read_bytes(), path
    # A holds it (QEMU opened its disk with it); B, whose jail has no secrets, does not.
    two_vms.runner.run(_open_own_disk_again(a, expect=None))
    two_vms.runner.run(_open_own_disk_again(b, expect="No secret with id 'disk-key'"))


async def _open_own_disk_again(vm: QemuVM, *, expect: str | None) -> None:
    qmp = await _qmp(vm)
    try:
        args = {
            "driver": "luks", "node-name": "again", "key-secret": "disk-key", "read-only": True,
            "file": {"driver": "file", "filename": str(vm.config.rootfs), "locking": "off"},
        }  # fmt: skip
        if expect is None:
            await qmp.execute("blockdev-add", args)
        else:
            with pytest.raises(ExecuteError, match=expect):
                await qmp.execute("blockdev-add", args)
    finally:
        await qmp.disconnect()


def _probe(vm: QemuVM, args: dict[str, object]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PROBE), str(vm.pid), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        check=False,
    )


def test_negative_a_process_confined_like_qemu_reaches_nothing_of_the_host(
    two_vms: TwoVMs,
) -> None:
    a, b, work = two_vms.a, two_vms.b, two_vms.work
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        socket.socket(socket.AF_UNIX) as abstract,
    ):
        abstract.bind("\0space-jail-test")
        abstract.listen()
        args = {
            "mode": "attack",
            "forbidden": [
                str(p)
                for p in (b.config.rootfs, b.config.memory_file, work / "data" / "master.key")
            ]
            + ["/etc/shadow", "/proc/1/environ"],
            "host_pid": b.pid,
            "port": listener.getsockname()[1],
            "other_qmp": str(b.config.qmp_socket),
            "abstract": "space-jail-test",
            "own_disk": str(a.config.rootfs),
            "own_run_dir": str(a.config.run_dir),
        }
        result = _probe(a, args)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # It really runs as A does: A's uid, inside A's PID namespace (A's QEMU is PID 1).
    assert report["uid"] == os.stat(f"/proc/{a.pid}").st_uid and report["uid"] in JAIL_UIDS
    assert report["pid"] != a.pid and report["pid"] < 100
    assert report.pop("control: read its own disk") == "ok"
    assert report.pop("control: write in its run dir") == "ok"
    refused = {k: v for k, v in report.items() if k not in ("uid", "pid")}
    assert refused and all(v != "ok" for v in refused.values()), refused
    assert refused["signal its own qemu"] == "EPERM"  # the seccomp filter
    assert refused["ptrace its own qemu"] == "EPERM"
    assert refused["read /etc/shadow"] == "ENOENT"  # the mount namespace
    assert a.alive and b.alive


def test_negative_a_memory_hog_and_a_fork_bomb_in_the_jail_stop_at_its_cgroup(
    two_vms: TwoVMs,
) -> None:
    a, b = two_vms.a, two_vms.b
    hog = _probe(a, {"mode": "memory"})
    assert hog.returncode == 128 + 9, (hog.returncode, hog.stderr)  # the cgroup's OOM kill
    bomb = _probe(a, {"mode": "fork"})
    assert bomb.returncode == 0, bomb.stderr
    report = json.loads(bomb.stdout)
    assert report["fork_error"] == "EAGAIN" and report["forks"] < 128, report
    assert b.alive  # the other sandbox runs on
