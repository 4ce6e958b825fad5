"""The guest's one NIC: read ``space.net=`` from the kernel command line and apply it.

The node appends ``space.net=<address>/<prefix>,<gateway>`` (for example
``space.net=192.0.2.2/30,192.0.2.1``) when a sandbox has a network; the gateway is
also the only DNS resolver. A guest without that word has no NIC and nothing here runs.

Everything is done with ioctls on an AF_INET socket (the guest has no /sbin/ip):
SIOCSIFADDR, SIOCSIFNETMASK, SIOCSIFFLAGS and SIOCADDRT. The byte layouts of the
kernel structures are built by the pure ``pack_*`` functions so they can be tested
outside a VM. Every failure of ``configure`` is a ``NetworkSetupError``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import ipaddress
import os
import re
import socket
import struct
import time
from collections.abc import Callable

from space.protocol import resolv_conf_text

__all__ = [
    "IFREQ_BYTES",
    "RTENTRY_BYTES",
    "NetConfig",
    "NetworkSetupError",
    "configure",
    "disable_ipv6",
    "find_interface",
    "interface_up",
    "net_arg",
    "pack_ifreq_addr",
    "pack_ifreq_flags",
    "pack_rtentry_default_route",
    "pack_sockaddr_in",
    "parse_net_arg",
    "resolv_conf_text",
    "wait_for_interface",
    "write_resolv_conf",
]

# <linux/sockios.h>, <linux/if.h>, <linux/route.h>
_SIOCADDRT = 0x890B
_SIOCGIFFLAGS, _SIOCSIFFLAGS = 0x8913, 0x8914
_SIOCSIFADDR, _SIOCSIFNETMASK = 0x8916, 0x891C
_IFF_UP = 0x1
_RTF_UP, _RTF_GATEWAY = 0x1, 0x2
_IFNAMSIZ = 16  # including the terminating NUL
#: sizeof(struct ifreq) and sizeof(struct rtentry) on x86_64.
IFREQ_BYTES = 40
RTENTRY_BYTES = 120
_IFNAME = re.compile(rf"[A-Za-z0-9_.-]{{1,{_IFNAMSIZ - 1}}}")
_MIN_PREFIX, _MAX_PREFIX = 8, 30
_NET_WORD = "space.net="
_SYS_NET = "/sys/class/net"
_PROC_IPV6_CONF = "/proc/sys/net/ipv6/conf"
#: IPv6 is switched off on the NIC and for interfaces created later ("default"); not
#: "all", which would also take ::1 off lo and break programs that bind localhost there.
_IPV6_OFF = ("default",)


class NetworkSetupError(Exception):
    """Configuring the network failed; ``step`` names what, ``detail`` says why."""

    def __init__(self, step: str, detail: str, *, interface: str | None = None) -> None:
        where = f" on {interface}" if interface else ""
        super().__init__(f"{step}{where}: {detail}")
        self.step = step
        self.detail = detail
        self.interface = interface


@dataclasses.dataclass(frozen=True)
class NetConfig:
    """The guest's address, its subnet's prefix length and the gateway (also DNS)."""

    address: ipaddress.IPv4Address
    prefix_len: int
    gateway: ipaddress.IPv4Address

    @property
    def netmask(self) -> ipaddress.IPv4Address:
        return self.network.netmask

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network((self.address, self.prefix_len), strict=False)


def net_arg(cmdline: str) -> str | None:
    """The raw value of the last ``space.net=`` word on a kernel command line, if any."""
    values = [w[len(_NET_WORD) :] for w in cmdline.split() if w.startswith(_NET_WORD)]
    return values[-1] if values else None


def parse_net_arg(cmdline: str) -> NetConfig | None:
    """The NetConfig of ``space.net=<address>/<prefix>,<gateway>``, or None.

    None when the word is absent or its value is not valid: IPv4 only (no leading
    zeros), prefix 8..30, address and gateway distinct usable hosts of that subnet.
    Use ``net_arg`` to tell an absent word from a bad one.
    """
    value = net_arg(cmdline)
    match = re.fullmatch(r"([0-9.]+)/([1-9][0-9]?),([0-9.]+)", value or "")
    if match is None:
        return None
    try:
        address = ipaddress.IPv4Address(match.group(1))
        gateway = ipaddress.IPv4Address(match.group(3))
    except ValueError:
        return None
    config = NetConfig(address, int(match.group(2)), gateway)
    return config if _valid(config) else None


def _valid(config: NetConfig) -> bool:
    if not _MIN_PREFIX <= config.prefix_len <= _MAX_PREFIX:
        return False
    network = config.network
    hosts = (config.address, config.gateway)
    return (
        config.address != config.gateway
        and all(host in network for host in hosts)
        and all(host not in (network.network_address, network.broadcast_address) for host in hosts)
        and not any(h.is_loopback or h.is_multicast or h.is_reserved for h in hosts)
        and not network.network_address.is_unspecified
    )


# --- byte layouts -------------------------------------------------------------------


def _name_bytes(interface: str) -> bytes:
    # What the kernel's dev_valid_name accepts, narrowed to the names it gives NICs.
    if interface in (".", "..") or not _IFNAME.fullmatch(interface):
        raise NetworkSetupError("interface name", f"not a valid name: {interface!r}")
    return interface.encode("ascii")


def pack_sockaddr_in(address: ipaddress.IPv4Address) -> bytes:
    """A 16-byte struct sockaddr_in: AF_INET (host order), port 0, the address, zeros."""
    return struct.pack("=HH4s8x", socket.AF_INET, 0, address.packed)


def pack_ifreq_addr(interface: str, address: ipaddress.IPv4Address) -> bytes:
    """A 40-byte struct ifreq with ``ifr_addr`` set (for SIOCSIFADDR, SIOCSIFNETMASK)."""
    return struct.pack("=16s16s8x", _name_bytes(interface), pack_sockaddr_in(address))


def pack_ifreq_flags(interface: str, flags: int) -> bytes:
    """A 40-byte struct ifreq with ``ifr_flags`` (a short) set (for SIOC[GS]IFFLAGS)."""
    return struct.pack("=16sH22x", _name_bytes(interface), flags & 0xFFFF)


_SockAddr = ctypes.c_ubyte * 16


class _RtEntry(ctypes.Structure):
    # struct rtentry from <linux/route.h>; ctypes applies the C ABI's alignment, which
    # on x86_64 puts rt_gateway at 24, rt_flags at 56 and rt_dev at 88 (120 in all).
    _fields_ = [
        ("rt_pad1", ctypes.c_ulong),
        ("rt_dst", _SockAddr),
        ("rt_gateway", _SockAddr),
        ("rt_genmask", _SockAddr),
        ("rt_flags", ctypes.c_ushort),
        ("rt_pad2", ctypes.c_short),
        ("rt_pad3", ctypes.c_ulong),
        ("rt_pad4", ctypes.c_void_p),
        ("rt_metric", ctypes.c_short),
        ("rt_dev", ctypes.c_char_p),
        ("rt_mtu", ctypes.c_ulong),
        ("rt_window", ctypes.c_ulong),
        ("rt_irtt", ctypes.c_ushort),
    ]


def pack_rtentry_default_route(gateway: ipaddress.IPv4Address) -> bytes:
    """A struct rtentry for ``default via <gateway>`` (for SIOCADDRT).

    rt_dev is NULL: the kernel picks the device whose subnet holds the gateway, so the
    interface must already be up with its address. rt_metric 0 means priority 0.
    """
    any_address = ipaddress.IPv4Address(0)
    entry = _RtEntry(
        rt_dst=_SockAddr.from_buffer_copy(pack_sockaddr_in(any_address)),
        rt_gateway=_SockAddr.from_buffer_copy(pack_sockaddr_in(gateway)),
        rt_genmask=_SockAddr.from_buffer_copy(pack_sockaddr_in(any_address)),
        rt_flags=_RTF_UP | _RTF_GATEWAY,
    )
    return bytes(entry)


# --- the interface ------------------------------------------------------------------


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def find_interface(sys_net: str = _SYS_NET) -> str | None:
    """The NIC to configure: the first virtio one, else the first other device-backed one.

    Interfaces without a ``device`` link (lo, sit0, tunl0, ...) are virtual and never
    chosen. Names are taken in sorted order, so the answer is stable.
    """
    devices = [n for n in _listdir(sys_net) if os.path.exists(f"{sys_net}/{n}/device")]
    for name in devices:
        driver = os.path.realpath(f"{sys_net}/{name}/device/driver")
        if os.path.basename(driver) == "virtio_net":
            return name
    return devices[0] if devices else None


def wait_for_interface(
    sys_net: str = _SYS_NET,
    *,
    timeout_s: float = 2.0,
    poll_s: float = 0.02,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """``find_interface``, polled every ``poll_s`` until one appears or ``timeout_s`` ends.

    The NIC's driver may finish probing just after init starts. None after the timeout.
    """
    deadline = clock() + timeout_s
    while True:
        name = find_interface(sys_net)
        if name is not None or clock() >= deadline:
            return name
        sleep(poll_s)


def _ioctl(sock: socket.socket, request: int, arg: bytes, step: str, interface: str) -> bytes:
    try:
        return fcntl.ioctl(sock, request, arg)
    except OSError as exc:
        raise NetworkSetupError(step, exc.strerror or str(exc), interface=interface) from exc


def interface_up(sock: socket.socket, interface: str) -> None:
    """Set IFF_UP on ``interface`` keeping its other flags; idempotent.

    Raises NetworkSetupError if the interface does not exist or the ioctl fails.
    """
    got = _ioctl(sock, _SIOCGIFFLAGS, pack_ifreq_flags(interface, 0), "read flags", interface)
    flags = struct.unpack_from("=H", got, _IFNAMSIZ)[0]
    _ioctl(sock, _SIOCSIFFLAGS, pack_ifreq_flags(interface, flags | _IFF_UP), "up", interface)


def _add_default_route(sock: socket.socket, gateway: ipaddress.IPv4Address) -> None:
    try:
        fcntl.ioctl(sock, _SIOCADDRT, pack_rtentry_default_route(gateway))
    except OSError as exc:
        if exc.errno != errno.EEXIST:  # the same route already there is success
            raise NetworkSetupError(f"default route via {gateway}", str(exc)) from exc


def disable_ipv6(interface: str, conf_dir: str = _PROC_IPV6_CONF) -> None:
    """Write "1" to ``<conf_dir>/<if>/disable_ipv6`` (and ``default``) where they exist.

    A kernel without IPv6 has no such files: nothing to do. Raises NetworkSetupError
    if a file exists but cannot be written.
    """
    for name in (_name_bytes(interface).decode(), *_IPV6_OFF):
        path = f"{conf_dir}/{name}/disable_ipv6"
        if not os.path.exists(path):
            continue
        try:
            with open(path, "w", encoding="ascii") as file:
                file.write("1")
        except OSError as exc:
            raise NetworkSetupError("disable IPv6", f"{path}: {exc}", interface=name) from exc


# --- resolv.conf --------------------------------------------------------------------


def write_resolv_conf(nameserver: ipaddress.IPv4Address, root: str = "/") -> None:
    """Atomically replace ``<root>/etc/resolv.conf`` (a temp file renamed over it).

    A symlink there (systemd-resolved's, say) is replaced by the file, never followed.
    Idempotent. Raises NetworkSetupError if /etc cannot be written; then the old
    file is untouched and no temp file is left behind.
    """
    etc = os.path.join(root, "etc")
    target, temp = os.path.join(etc, "resolv.conf"), os.path.join(etc, ".resolv.conf.space")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)  # left by a boot that died mid-write
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with open(fd, "w", encoding="ascii") as file:
            os.fchmod(fd, 0o644)  # whatever the umask
            file.write(resolv_conf_text(nameserver))
            file.flush()
            os.fsync(fd)
        os.replace(temp, target)  # rename(2) replaces a symlink, it does not follow it
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise NetworkSetupError("write resolv.conf", str(exc)) from exc


# --- all together -------------------------------------------------------------------


def configure(config: NetConfig, interface: str | None = None) -> None:
    """Give ``interface`` (default: ``find_interface()``) the address of ``config``.

    In order: IPv6 off on it, address, netmask, IFF_UP, ``default via gateway``, and
    /etc/resolv.conf naming the gateway. Idempotent: a second call with the same
    config changes nothing (an existing identical route counts as success). Raises
    NetworkSetupError at the first step that fails; the steps before it stay applied.
    """
    if interface is None:
        interface = find_interface()
    if interface is None:
        raise NetworkSetupError("find interface", f"no network interface in {_SYS_NET}")
    disable_ipv6(interface)  # before IFF_UP, so no link-local address is ever announced
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except OSError as exc:
        raise NetworkSetupError("open socket", str(exc)) from exc
    with sock:
        addr = pack_ifreq_addr(interface, config.address)
        _ioctl(sock, _SIOCSIFADDR, addr, f"set address {config.address}", interface)
        mask = pack_ifreq_addr(interface, config.netmask)
        _ioctl(sock, _SIOCSIFNETMASK, mask, f"set netmask {config.netmask}", interface)
        interface_up(sock, interface)
        _add_default_route(sock, config.gateway)
    write_resolv_conf(config.gateway)
