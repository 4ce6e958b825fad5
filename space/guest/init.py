"""PID 1 of a SPACE guest: mount the basics, grow the root filesystem to its disk, name
the host, set up the network, run and babysit spaced.

Exec'd from the initramfs as ``python3 -B -m space.guest.init``. It must never exit (a
PID 1 exit panics the kernel): it reaps every child (orphans are re-parented to it),
restarts spaced with a backoff when it dies, and on SIGTERM/SIGINT syncs and powers off.
The network (``space.net=``, see ``_network``) is configured before spaced starts,
because the node may test connectivity right after spaced's HELLO.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import types

from . import PACKAGE_ROOT
from ._identity import write_host_name
from ._network import (
    NetworkSetupError,
    configure,
    interface_up,
    net_arg,
    parse_net_arg,
    wait_for_interface,
)

__all__ = ["backoff_s", "hostname_from_cmdline", "main", "network_up"]

_MOUNTS = (
    # (source, target, fstype, flags, data)
    ("proc", "/proc", "proc", 0, ""),
    ("sysfs", "/sys", "sysfs", 0, ""),
    ("devtmpfs", "/dev", "devtmpfs", 0, "mode=0755"),
    ("devpts", "/dev/pts", "devpts", 0, "gid=5,mode=620,ptmxmode=666"),
    ("tmpfs", "/dev/shm", "tmpfs", 0, "mode=1777"),
    ("tmpfs", "/run", "tmpfs", 0, "mode=0755"),
    ("tmpfs", "/tmp", "tmpfs", 0, "mode=1777"),
)
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_RB_POWER_OFF = 0x4321FEDC
#: How long a NIC may take to appear after init starts (its driver probes asynchronously).
_NIC_WAIT_S = 2.0
#: Backoff between spaced restarts; reset once it has run this long.
_BACKOFF_MAX_S = 5.0
_HEALTHY_S = 30.0

#: _IOW('f', 16, __u64): grow a mounted ext4 to a block count (what resize2fs does online).
_EXT4_IOC_RESIZE_FS = 0x40086610
_ROOT_DEVICE = "vda"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _log(message: str) -> None:
    with contextlib.suppress(OSError):
        sys.stderr.write(f"space-init: {message}\n")
        sys.stderr.flush()


def _mounted(target: str) -> bool:
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            return any(line.split()[1] == target for line in mounts if line.strip())
    except OSError:
        return False


def mount_basics() -> None:
    for source, target, fstype, flags, data in _MOUNTS:
        if _mounted(target):
            continue
        with contextlib.suppress(OSError):
            os.makedirs(target, exist_ok=True)
        flags |= _MS_NOSUID | (0 if fstype in ("devtmpfs", "tmpfs") else _MS_NOEXEC)
        result = _libc.mount(
            source.encode(), target.encode(), fstype.encode(), flags, data.encode()
        )
        if result != 0:
            _log(f"mount {target} failed: {os.strerror(ctypes.get_errno())}")


def hostname_from_cmdline(cmdline: str) -> str | None:
    """The value of ``space.hostname=`` on a kernel command line, if any."""
    for word in cmdline.split():
        if word.startswith("space.hostname="):
            name = word.split("=", 1)[1]
            if name and len(name) <= 64:
                return name
    return None


def _kernel_cmdline() -> str:
    try:
        with open("/proc/cmdline", encoding="utf-8") as file:
            return file.read()
    except OSError as exc:
        _log(f"cannot read /proc/cmdline: {exc}")
        return ""


def set_hostname(cmdline: str) -> None:
    try:
        name = hostname_from_cmdline(cmdline)
        if name is not None:
            socket.sethostname(name)
            write_host_name("/", name)
    except OSError as exc:
        _log(f"cannot set the hostname: {exc}")


def loopback_up() -> None:
    """Bring ``lo`` up with SIOCSIFFLAGS (no /sbin/ip needed); failure is only logged."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            interface_up(sock, "lo")
    except (OSError, NetworkSetupError) as exc:
        _log(f"cannot bring lo up: {exc}")


def network_up(cmdline: str) -> None:
    """Configure the NIC from ``space.net=`` on ``cmdline``; without it, do nothing.

    Never raises (PID 1 must not die): a bad value, a NIC that does not appear within
    ``_NIC_WAIT_S`` or a failed step is logged and the guest boots without a network.
    """
    value = net_arg(cmdline)
    if value is None:
        return
    config = parse_net_arg(cmdline)
    if config is None:
        _log(f"ignoring an invalid space.net={value!r}")
        return
    interface = wait_for_interface(timeout_s=_NIC_WAIT_S)
    if interface is None:
        _log(f"space.net= given but no network interface appeared within {_NIC_WAIT_S} s")
        return
    try:
        configure(config, interface)
    except Exception as exc:  # NetworkSetupError, or a bug: log it either way
        _log(f"network setup failed: {exc}")
        return
    _log(f"{interface}: {config.address}/{config.prefix_len} via {config.gateway}")


def backoff_s(failures: int) -> float:
    """Pause before the next restart after ``failures`` quick deaths in a row."""
    return 0.0 if failures <= 0 else min(0.25 * 2 ** (failures - 1), _BACKOFF_MAX_S)


def start_spaced() -> int:
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "PYTHONPATH": PACKAGE_ROOT,
        "HOME": "/root",
        # Under QEMU TCG `rep movsb` is emulated byte by byte: glibc's vector copy loops
        # move spaced's bulk data several times faster (measured 0.82 -> 0.41 s for
        # 100 MiB); on real CPUs the difference for these sizes is noise.
        "GLIBC_TUNABLES": "glibc.cpu.x86_rep_movsb_threshold=4194304",
    }
    proc = subprocess.Popen([sys.executable, "-B", "-m", "space.guest"], env=env, cwd="/")
    return proc.pid


def _power_off(signum: int, frame: types.FrameType | None) -> None:
    _log(f"signal {signum}: powering off")
    with contextlib.suppress(OSError):
        os.kill(-1, signal.SIGTERM)
    time.sleep(0.5)
    os.sync()
    _libc.reboot(_RB_POWER_OFF)


def supervise() -> None:
    """Reap children forever, restarting spaced when it dies."""
    failures = 0
    spaced, started = start_spaced(), time.monotonic()
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            time.sleep(1.0)
            pid, status = spaced, 0
        except OSError:
            continue
        if pid != spaced:
            continue
        _log(f"spaced exited with status {status}")
        failures = 0 if time.monotonic() - started > _HEALTHY_S else failures + 1
        time.sleep(backoff_s(failures))
        try:
            spaced, started = start_spaced(), time.monotonic()
        except OSError as exc:
            _log(f"cannot start spaced: {exc}")


def grow_root() -> None:
    """Grow the root ext4 to its whole disk (a no-op when it fills it already).

    The node makes a new sandbox's disk larger than its template's by extending the
    encrypted image; only the guest can see, and so grow, the filesystem inside.
    Failure is logged, never fatal: the guest then runs on the smaller filesystem.
    """
    try:
        with open(f"/sys/block/{_ROOT_DEVICE}/size") as f:
            disk_bytes = int(f.read()) * 512
        blocks = disk_bytes // os.statvfs("/").f_frsize
        fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, _EXT4_IOC_RESIZE_FS, struct.pack("=Q", blocks))
        finally:
            os.close(fd)
    except (OSError, ValueError) as exc:
        _log(f"cannot grow the root filesystem: {exc}")


def main() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _power_off)
    mount_basics()
    grow_root()
    cmdline = _kernel_cmdline()
    set_hostname(cmdline)
    loopback_up()
    network_up(cmdline)  # before spaced: the node may test connectivity after HELLO
    while True:  # never return: PID 1 exiting panics the kernel
        try:
            supervise()
        except Exception as exc:
            _log(f"supervisor failed: {exc!r}")
            time.sleep(1.0)


if __name__ == "__main__":
    main()
