"""The pieces of the guest's PID 1 and transport that can run outside a VM."""

from __future__ import annotations

from pathlib import Path

from space.guest._transport import find_port
from space.guest.init import backoff_s, hostname_from_cmdline


def test_hostname_comes_from_the_kernel_command_line() -> None:
    cmdline = "console=ttyS0 quiet space.hostname=sbx-1234 root=/dev/vda\n"
    assert hostname_from_cmdline(cmdline) == "sbx-1234"


def test_negative_a_missing_or_empty_hostname_parameter_gives_none() -> None:
    assert hostname_from_cmdline("console=ttyS0 quiet") is None
    assert hostname_from_cmdline("space.hostname= x") is None
    assert hostname_from_cmdline("space.hostname=" + "a" * 65) is None


def test_restart_backoff_grows_and_is_capped() -> None:
    delays = [backoff_s(n) for n in range(8)]
    assert delays[0] == 0.0 and delays[1] == 0.25
    assert delays == sorted(delays)
    assert max(delays) == 5.0


def test_the_port_is_found_by_its_virtio_name(tmp_path: Path) -> None:
    for port, name in (("vport0p0", "org.qemu.guest_agent.0"), ("vport1p1", "space.agent")):
        (tmp_path / port).mkdir()
        (tmp_path / port / "name").write_text(name + "\n")
    assert find_port("space.agent", str(tmp_path)) == "/dev/vport1p1"


def test_negative_no_port_of_that_name_gives_none(tmp_path: Path) -> None:
    assert find_port("space.agent", str(tmp_path)) is None
