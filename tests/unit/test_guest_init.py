"""The pieces of the guest's PID 1 and transport that can run outside a VM."""

from __future__ import annotations

import signal
from collections.abc import Callable
from ipaddress import IPv4Address
from pathlib import Path

import pytest

from space.guest import init
from space.guest._network import NetConfig, NetworkSetupError
from space.guest._transport import find_port
from space.guest.init import backoff_s, hostname_from_cmdline, network_up

NET_CMDLINE = "console=ttyS0 space.hostname=sbx-1 space.net=192.0.2.2/30,192.0.2.1\n"


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


class NetworkCalls:
    """Stands in for the NIC: records what init asks of it."""

    def __init__(self, interface: str | None = "eth0", error: Exception | None = None) -> None:
        self.interface = interface
        self.error = error
        self.waits: list[float] = []
        self.configured: list[tuple[NetConfig, str | None]] = []

    def wait_for_interface(self, *, timeout_s: float) -> str | None:
        self.waits.append(timeout_s)
        return self.interface

    def configure(self, config: NetConfig, interface: str | None = None) -> None:
        if self.error is not None:
            raise self.error
        self.configured.append((config, interface))


@pytest.fixture
def nic(monkeypatch: pytest.MonkeyPatch) -> NetworkCalls:
    calls = NetworkCalls()
    monkeypatch.setattr(init, "wait_for_interface", calls.wait_for_interface)
    monkeypatch.setattr(init, "configure", calls.configure)
    return calls


def test_the_network_is_configured_from_space_net_after_waiting_for_the_nic(
    nic: NetworkCalls,
) -> None:
    network_up(NET_CMDLINE)
    assert nic.waits == [2.0]
    expected = NetConfig(IPv4Address("192.0.2.2"), 30, IPv4Address("192.0.2.1"))
    assert nic.configured == [(expected, "eth0")]


def test_without_space_net_the_guest_boots_as_before(nic: NetworkCalls) -> None:
    network_up("console=ttyS0 space.hostname=sbx-1\n")
    assert nic.waits == [] and nic.configured == []


def test_negative_an_invalid_space_net_is_logged_and_nothing_is_configured(
    nic: NetworkCalls, capsys: pytest.CaptureFixture[str]
) -> None:
    network_up("space.net=192.0.2.2/31,192.0.2.1")
    assert nic.waits == [] and nic.configured == []
    assert "invalid space.net='192.0.2.2/31,192.0.2.1'" in capsys.readouterr().err


def test_negative_a_nic_that_never_appears_is_logged(
    nic: NetworkCalls, capsys: pytest.CaptureFixture[str]
) -> None:
    nic.interface = None
    network_up(NET_CMDLINE)
    assert nic.configured == []
    assert "no network interface appeared" in capsys.readouterr().err


@pytest.mark.parametrize(
    "error",
    [NetworkSetupError("default route via 192.0.2.1", "Network is unreachable"), KeyError(1)],
)
def test_negative_a_failed_network_setup_is_logged_and_never_raised(
    nic: NetworkCalls, capsys: pytest.CaptureFixture[str], error: Exception
) -> None:
    nic.error = error
    network_up(NET_CMDLINE)
    assert "network setup failed" in capsys.readouterr().err


class _Stop(BaseException):
    """Ends main()'s endless loop in a test (it catches only Exception)."""


def test_spaced_starts_only_after_the_network_is_configured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps: list[str] = []

    def step(name: str, stop: bool = False) -> Callable[..., None]:
        def record(*args: object) -> None:
            steps.append(name)
            if stop:
                raise _Stop

        return record

    monkeypatch.setattr(signal, "signal", step("signal"))  # keep pytest's own handlers
    for name in ("mount_basics", "set_hostname", "loopback_up", "network_up"):
        monkeypatch.setattr(init, name, step(name))
    monkeypatch.setattr(init, "_kernel_cmdline", lambda: NET_CMDLINE)
    monkeypatch.setattr(init, "supervise", step("supervise", stop=True))
    with pytest.raises(_Stop):
        init.main()
    assert steps[2:] == ["mount_basics", "set_hostname", "loopback_up", "network_up", "supervise"]
