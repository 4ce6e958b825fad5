"""The built ``base`` image boots under QEMU: kernel, initramfs, rootfs, /usr/lib/space/init.

Each test boots a reflink copy of the cached rootfs (never the cached file itself) with
a hard deadline, and kills QEMU in a ``finally``. The probe test replaces the guest
init module in its copy (with ``debugfs``, on the image file: nothing is mounted) by a
script that reports from inside the guest and powers off, which proves the whole
chain up to ``python3 -m space.guest.init`` as PID 1.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.node.images import GuestImage, build_template

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1200)]

SWITCH_MARKER = "space-initramfs: switching to /usr/lib/space/init"
BOOT_DEADLINE_S = 90.0

PROBE = """\
import ctypes, os
names = [open(f"/sys/class/virtio-ports/{p}/name").read().strip()
         for p in os.listdir("/sys/class/virtio-ports")]
with open("/dev/console", "w") as console:
    console.write(f"SPACE-PROBE pid={os.getpid()} host={open('/etc/hostname').read().strip()}\\n")
    console.write(f"SPACE-PROBE ports={names}\\n")
    user = [line.strip() for line in open("/etc/passwd") if line.startswith("user:")]
    console.write(f"SPACE-PROBE user={user}\\n")
os.sync()
ctypes.CDLL(None).reboot(0x4321FEDC)  # RB_POWER_OFF: QEMU exits
"""


@pytest.fixture(scope="module")
def image() -> GuestImage:
    return build_template("base", progress=lambda line: print(f"image build: {line}"))


@pytest.fixture
def rootfs_copy(image: GuestImage, tmp_path: Path) -> Path:
    copy = tmp_path / "rootfs.img"
    subprocess.run(
        ["cp", "--reflink=auto", "--sparse=always", str(image.rootfs), str(copy)], check=True
    )
    return copy


@contextlib.contextmanager
def qemu(
    image: GuestImage, rootfs: Path | None, console: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """Run QEMU (TCG) on ``rootfs`` (None: no disk) with the console in ``console``.

    QEMU is killed and reaped when the block exits, whatever happened inside.
    """
    sock_dir = Path(tempfile.mkdtemp(prefix="space-img-", dir="/tmp"))  # short AF_UNIX path
    argv = [
        "qemu-system-x86_64",
        "-accel", "tcg,tb-size=64",
        "-m", "256",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-serial", f"file:{console}",
        "-kernel", str(image.kernel),
        "-initrd", str(image.initrd),
        "-append", image.kernel_cmdline,
        "-device", "virtio-serial-pci",
        "-chardev", f"socket,id=agent,path={sock_dir / 'a.sock'},server=on,wait=off",
        "-device", "virtserialport,chardev=agent,name=space.agent",
    ]  # fmt: skip
    if rootfs is not None:
        argv += ["-drive", f"file={rootfs},if=none,id=root,format=raw"]
        argv += ["-device", "virtio-blk-pci,drive=root"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if proc.stderr:
            proc.stderr.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert proc.poll() is not None


def wait_for(console: Path, text: str, proc: subprocess.Popen[bytes]) -> tuple[str, float]:
    """Console contents once ``text`` shows (or QEMU exits, or the deadline passes)."""
    start = time.monotonic()
    while time.monotonic() - start < BOOT_DEADLINE_S:
        log = console.read_text(errors="replace") if console.exists() else ""
        if text in log or proc.poll() is not None:
            return log, time.monotonic() - start
        time.sleep(0.05)
    return console.read_text(errors="replace"), time.monotonic() - start


def test_shipped_image_switches_root_to_the_space_init(
    image: GuestImage, rootfs_copy: Path, tmp_path: Path
) -> None:
    cached_mtime = image.rootfs.stat().st_mtime_ns
    console = tmp_path / "console.log"
    with qemu(image, rootfs_copy, console) as proc:
        log, elapsed = wait_for(console, SWITCH_MARKER, proc)
        print(f"switch_root after {elapsed:.2f} s")
        assert SWITCH_MARKER in log, log[-3000:]
        assert "FATAL" not in log
    assert image.rootfs.stat().st_mtime_ns == cached_mtime


def test_guest_init_module_runs_as_pid_1_with_the_image_setup(
    image: GuestImage, rootfs_copy: Path, tmp_path: Path
) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    target = "/usr/lib/space/python/space/guest/init.py"
    for request in (f"rm {target}", f"write {probe} {target}"):
        subprocess.run(["debugfs", "-w", "-R", request, str(rootfs_copy)], check=True)
    console = tmp_path / "console.log"
    with qemu(image, rootfs_copy, console) as proc:
        proc.wait(timeout=BOOT_DEADLINE_S)  # the probe powers the guest off
        log = console.read_text(errors="replace")
    assert SWITCH_MARKER in log, log[-3000:]
    assert "SPACE-PROBE pid=1 host=space" in log, log[-3000:]
    assert "SPACE-PROBE ports=['space.agent']" in log
    assert "SPACE-PROBE user=['user:x:1000:1000:SPACE user:/home/user:/bin/sh']" in log


def test_negative_missing_root_disk_is_reported_and_powers_off_instead_of_hanging(
    image: GuestImage, tmp_path: Path
) -> None:
    console = tmp_path / "console.log"
    with qemu(image, None, console) as proc:
        proc.wait(timeout=BOOT_DEADLINE_S)  # the initramfs gives up after 10 s
        log = console.read_text(errors="replace")
    assert "space-initramfs: FATAL: root disk /dev/vda did not appear" in log, log[-3000:]
    assert SWITCH_MARKER not in log


def test_rebuild_of_an_unchanged_template_is_reused_at_once(image: GuestImage) -> None:
    start = time.monotonic()
    again = build_template("base")
    elapsed = time.monotonic() - start
    assert again == image
    assert elapsed < 0.5
