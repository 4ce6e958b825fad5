"""The guest's network setup, the parts that run outside a VM: parsing, byte layouts, files.

The ioctls themselves need a VM (tests/integration); here the structures they are given
are checked byte by byte against the x86_64 layouts of <linux/if.h> and <linux/route.h>.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from ipaddress import IPv4Address
from pathlib import Path

import pytest

from space.guest._network import (
    IFREQ_BYTES,
    RTENTRY_BYTES,
    NetConfig,
    NetworkSetupError,
    disable_ipv6,
    find_interface,
    net_arg,
    pack_ifreq_addr,
    pack_ifreq_flags,
    pack_rtentry_default_route,
    pack_sockaddr_in,
    parse_net_arg,
    resolv_conf_text,
    wait_for_interface,
    write_resolv_conf,
)

GATEWAY = IPv4Address("192.0.2.1")
RESOLV_CONF = "nameserver 192.0.2.1\noptions timeout:2 attempts:2\n"


# --- space.net= ---------------------------------------------------------------------


def test_the_network_comes_from_the_kernel_command_line() -> None:
    config = parse_net_arg("console=ttyS0 space.net=192.0.2.2/30,192.0.2.1 quiet\n")
    assert config == NetConfig(IPv4Address("192.0.2.2"), 30, GATEWAY)
    assert config.netmask == IPv4Address("255.255.255.252")


@pytest.mark.parametrize(
    ("value", "netmask"),
    [("10.0.0.2/8,10.255.255.254", "255.0.0.0"), ("10.0.0.2/30,10.0.0.1", "255.255.255.252")],
)
def test_prefixes_at_both_ends_of_the_allowed_range_are_accepted(value: str, netmask: str) -> None:
    config = parse_net_arg(f"space.net={value}")
    assert config is not None and config.netmask == IPv4Address(netmask)


def test_the_last_space_net_word_wins_like_other_kernel_parameters() -> None:
    config = parse_net_arg("space.net=10.0.0.2/30,10.0.0.1 space.net=192.0.2.2/30,192.0.2.1")
    assert config is not None and config.gateway == GATEWAY


def test_no_space_net_word_means_no_network() -> None:
    assert net_arg("console=ttyS0 space.hostname=sbx-1 space.network=x") is None
    assert parse_net_arg("console=ttyS0 space.hostname=sbx-1") is None


NEGATIVE_VALUES = {
    "empty": "",
    "no prefix": "192.0.2.2,192.0.2.1",
    "no gateway": "192.0.2.2/30",
    "empty gateway": "192.0.2.2/30,",
    "two gateways": "192.0.2.2/30,192.0.2.1,192.0.2.1",
    "ipv6": "2001:db8::2/64,2001:db8::1",
    "prefix 7": "10.0.0.2/7,10.0.0.1",
    "prefix 31": "192.0.2.2/31,192.0.2.3",
    "prefix 32": "192.0.2.2/32,192.0.2.1",
    "prefix 0": "192.0.2.2/0,192.0.2.1",
    "prefix with a leading zero": "192.0.2.2/030,192.0.2.1",
    "prefix not a number": "192.0.2.2/ab,192.0.2.1",
    "prefix as a netmask": "192.0.2.2/255.255.255.252,192.0.2.1",
    "octet with a leading zero": "192.0.2.02/30,192.0.2.1",
    "octet over 255": "192.0.2.256/24,192.0.2.1",
    "three octets": "192.0.2/24,192.0.2.1",
    "a host name": "sandbox/30,192.0.2.1",
    "non-ascii digits": "١٩٢.0.2.2/30,192.0.2.1",
    "gateway outside the subnet": "192.0.2.2/30,192.0.2.5",
    "gateway equals the address": "192.0.2.2/30,192.0.2.2",
    "address is the network address": "192.0.2.0/30,192.0.2.1",
    "address is the broadcast address": "192.0.2.3/30,192.0.2.1",
    "gateway is the broadcast address": "192.0.2.2/30,192.0.2.3",
    "loopback": "127.0.0.2/8,127.0.0.1",
    "multicast": "224.0.0.2/24,224.0.0.1",
    "reserved": "240.0.0.2/24,240.0.0.1",
    "this network": "0.0.0.2/8,0.0.0.1",
}


@pytest.mark.parametrize("value", NEGATIVE_VALUES.values(), ids=NEGATIVE_VALUES.keys())
def test_negative_an_invalid_space_net_value_gives_none(value: str) -> None:
    cmdline = f"console=ttyS0 space.net={value} quiet"
    assert net_arg(cmdline) == value  # present, so init can log the bad value
    assert parse_net_arg(cmdline) is None


def test_negative_a_valid_word_before_an_invalid_last_one_is_not_used() -> None:
    assert parse_net_arg("space.net=192.0.2.2/30,192.0.2.1 space.net=192.0.2.2/31,x") is None


# --- byte layouts -------------------------------------------------------------------


def test_a_sockaddr_in_is_family_port_address_and_zeros() -> None:
    packed = pack_sockaddr_in(GATEWAY)
    assert packed == b"\x02\x00" + b"\x00\x00" + b"\xc0\x00\x02\x01" + bytes(8)


def test_an_address_ifreq_is_the_padded_name_then_a_sockaddr_in() -> None:
    packed = pack_ifreq_addr("eth0", IPv4Address("255.255.255.252"))
    assert len(packed) == IFREQ_BYTES == 40
    assert packed[:16] == b"eth0" + bytes(12)
    assert packed[16:32] == b"\x02\x00\x00\x00\xff\xff\xff\xfc" + bytes(8)
    assert packed[32:] == bytes(8)


def test_a_flags_ifreq_holds_the_flags_as_a_short_after_the_name() -> None:
    packed = pack_ifreq_flags("eth0", 0x1043)
    assert len(packed) == IFREQ_BYTES
    assert packed == b"eth0" + bytes(12) + b"\x43\x10" + bytes(22)


def test_a_default_route_rtentry_has_the_x86_64_layout() -> None:
    packed = pack_rtentry_default_route(GATEWAY)
    expected = bytearray(120)  # <linux/route.h> struct rtentry, offsets for x86_64
    expected[8:10] = b"\x02\x00"  # rt_dst: AF_INET 0.0.0.0
    expected[24:40] = b"\x02\x00\x00\x00\xc0\x00\x02\x01" + bytes(8)  # rt_gateway
    expected[40:42] = b"\x02\x00"  # rt_genmask: AF_INET 0.0.0.0
    expected[56:58] = b"\x03\x00"  # rt_flags: RTF_UP | RTF_GATEWAY
    assert len(packed) == RTENTRY_BYTES == 120
    assert packed == bytes(expected)
    # Everything after rt_flags is zero: rt_metric 0 and rt_dev (offset 88) NULL.
    assert packed[58:] == bytes(62)


def test_the_rtentry_layout_matches_an_independent_struct_format() -> None:
    # rt_pad1, dst, gateway, genmask, flags, pad2, (4 align), pad3, pad4, metric, (6),
    # dev, mtu, window, irtt, (6): the C ABI's alignment written out by hand.
    layout = "=Q16s16s16sHh4xQQh6xQQQH6x"
    fields = struct.unpack(layout, pack_rtentry_default_route(GATEWAY))
    assert struct.calcsize(layout) == RTENTRY_BYTES
    assert fields[2] == pack_sockaddr_in(GATEWAY)
    assert fields[4] == 0x3
    assert fields[8] == 0  # rt_dev


@pytest.mark.parametrize("name", ["", "a" * 16, "eth/0", "eth 0", "ethé", ".."])
def test_negative_an_invalid_interface_name_is_refused_before_any_ioctl(name: str) -> None:
    with pytest.raises(NetworkSetupError) as caught:
        pack_ifreq_flags(name, 0)
    assert caught.value.step == "interface name"


def test_the_longest_interface_name_fits_with_its_nul() -> None:
    assert pack_ifreq_flags("a" * 15, 0)[:16] == b"a" * 15 + b"\x00"


# --- /etc/resolv.conf ---------------------------------------------------------------


def _etc(tmp_path: Path) -> Path:
    (tmp_path / "etc").mkdir()
    return tmp_path / "etc"


def test_resolv_conf_names_the_gateway_as_the_only_resolver(tmp_path: Path) -> None:
    etc = _etc(tmp_path)
    (etc / "resolv.conf").write_text("nameserver 8.8.8.8\n")
    write_resolv_conf(GATEWAY, str(tmp_path))
    assert resolv_conf_text(GATEWAY) == RESOLV_CONF
    assert (etc / "resolv.conf").read_text() == RESOLV_CONF
    assert (etc / "resolv.conf").stat().st_mode & 0o777 == 0o644
    assert sorted(os.listdir(etc)) == ["resolv.conf"]  # no temp file left


def test_a_resolv_conf_symlink_is_replaced_not_followed(tmp_path: Path) -> None:
    etc = _etc(tmp_path)
    stub = tmp_path / "stub-resolv.conf"
    stub.write_text("nameserver 127.0.0.53\n")
    (etc / "resolv.conf").symlink_to(stub)
    write_resolv_conf(GATEWAY, str(tmp_path))
    assert not (etc / "resolv.conf").is_symlink()
    assert (etc / "resolv.conf").read_text() == RESOLV_CONF
    assert stub.read_text() == "nameserver 127.0.0.53\n"


def test_writing_resolv_conf_twice_is_the_same_as_once(tmp_path: Path) -> None:
    etc = _etc(tmp_path)
    (etc / ".resolv.conf.space").write_text("left by a crash")
    write_resolv_conf(GATEWAY, str(tmp_path))
    write_resolv_conf(GATEWAY, str(tmp_path))
    assert sorted(os.listdir(etc)) == ["resolv.conf"]
    assert (etc / "resolv.conf").read_text() == RESOLV_CONF


def test_negative_resolv_conf_without_an_etc_directory_fails_and_creates_nothing(
    tmp_path: Path,
) -> None:
    with pytest.raises(NetworkSetupError) as caught:
        write_resolv_conf(GATEWAY, str(tmp_path))
    assert caught.value.step == "write resolv.conf"
    assert os.listdir(tmp_path) == []


def test_negative_a_directory_in_the_way_of_resolv_conf_fails_and_stays(
    tmp_path: Path,
) -> None:
    etc = _etc(tmp_path)
    (etc / "resolv.conf").mkdir()
    with pytest.raises(NetworkSetupError):
        write_resolv_conf(GATEWAY, str(tmp_path))
    assert (etc / "resolv.conf").is_dir()
    assert sorted(os.listdir(etc)) == ["resolv.conf"]


# --- IPv6 off -----------------------------------------------------------------------


def _ipv6_conf(tmp_path: Path, *names: str) -> Path:
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "disable_ipv6").write_text("0\n")
    return tmp_path


def test_ipv6_is_disabled_on_the_nic_and_for_new_interfaces_but_not_on_lo(
    tmp_path: Path,
) -> None:
    conf = _ipv6_conf(tmp_path, "eth0", "default", "all", "lo")
    disable_ipv6("eth0", str(conf))
    state = {n: (conf / n / "disable_ipv6").read_text() for n in ("eth0", "default", "all", "lo")}
    assert state == {"eth0": "1", "default": "1", "all": "0\n", "lo": "0\n"}


def test_a_kernel_without_ipv6_needs_nothing_disabled(tmp_path: Path) -> None:
    disable_ipv6("eth0", str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_negative_an_unwritable_ipv6_switch_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "eth0" / "disable_ipv6").mkdir(parents=True)
    with pytest.raises(NetworkSetupError) as caught:
        disable_ipv6("eth0", str(tmp_path))
    assert caught.value.interface == "eth0"


# --- finding the NIC ----------------------------------------------------------------


def _sys_net(tmp_path: Path, interfaces: dict[str, str | None]) -> Path:
    """A fake /sys/class/net: name -> driver of its device (None: a virtual interface)."""
    net = tmp_path / "class" / "net"
    net.mkdir(parents=True)
    for name, driver in interfaces.items():
        (net / name).mkdir()
        if driver is not None:
            drivers = tmp_path / "bus" / "drivers" / driver
            drivers.mkdir(parents=True, exist_ok=True)
            (tmp_path / "devices" / name).mkdir(parents=True)
            (tmp_path / "devices" / name / "driver").symlink_to(drivers)
            (net / name / "device").symlink_to(tmp_path / "devices" / name)
    return net


def test_the_virtio_nic_is_chosen_over_other_interfaces(tmp_path: Path) -> None:
    net = _sys_net(tmp_path, {"lo": None, "sit0": None, "eth0": "e1000", "eth1": "virtio_net"})
    assert find_interface(str(net)) == "eth1"


def test_without_a_virtio_nic_the_first_device_backed_one_is_chosen(tmp_path: Path) -> None:
    net = _sys_net(tmp_path, {"lo": None, "eth1": "e1000", "eth0": "e1000"})
    assert find_interface(str(net)) == "eth0"


def test_negative_only_virtual_interfaces_give_none(tmp_path: Path) -> None:
    net = _sys_net(tmp_path, {"lo": None, "sit0": None, "tunl0": None})
    assert find_interface(str(net)) is None
    assert find_interface(str(tmp_path / "missing")) is None


class FakeClock:
    """A monotonic clock that only moves when slept on."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _appearing_after(sleeps: int, clock: FakeClock, net: Path) -> Callable[[float], None]:
    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if len(clock.sleeps) == sleeps:
            _sys_net(net.parent.parent, {"eth0": "virtio_net"})

    return sleep


def test_a_nic_that_appears_late_is_waited_for(tmp_path: Path) -> None:
    clock = FakeClock()
    net = tmp_path / "class" / "net"
    sleep = _appearing_after(3, clock, net)
    found = wait_for_interface(str(net), timeout_s=2.0, poll_s=0.02, clock=clock, sleep=sleep)
    assert found == "eth0"
    assert clock.sleeps == [0.02] * 3


def test_negative_waiting_for_a_nic_gives_up_after_the_timeout(tmp_path: Path) -> None:
    clock = FakeClock()
    net = _sys_net(tmp_path, {"lo": None})
    found = wait_for_interface(str(net), timeout_s=2.0, poll_s=0.02, clock=clock, sleep=clock.sleep)
    assert found is None
    assert 2.0 <= clock.now - 100.0 <= 2.0 + 0.02 + 1e-9
    assert all(s == 0.02 for s in clock.sleeps)
