"""The root broker: its request set is closed and typed, and nothing outside its scope
is touched, whatever the node agent asks (a compromised agent asks anything).

The broker runs as it does for a node (its own process, a socket pair); every refusal
is checked to leave nothing behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.node.api import InvalidArgument, NodeError
from space.node.network import netns
from space.node.privileged import RootBroker
from space.node.privileged._jails import share, share_held
from space.node.privileged._network import readable_directory
from space.node.privileged.pinned import pin, pin_parent
from space.node.privileged.requests import (
    MAX_LINE_BYTES,
    BindListeners,
    CreateNetns,
    DeleteSubvolume,
    LaunchVm,
    LimitSubvolume,
    MountPool,
    RequestError,
    SetEgress,
    StartGateway,
    StopGateways,
    decode,
    encode,
)
from space.node.vmm.jail import JAIL_UIDS
from tests.root_broker import netns_name_of, root_broker


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RootBroker]:
    if os.geteuid() != 0:
        pytest.fail("the root broker needs root: run the suite as root")
    with root_broker(tmp_path / "node") as started:
        yield started


def _launch(**changes: object) -> LaunchVm:
    fields: dict[str, object] = {
        "name": "vm-1", "argv": ["true"], "binds": [], "owned": [], "netns": None,
        "tap": "tap0", "memory_mib": 64, "cpus": 1, "stderr_log": "/tmp/x.log",
        "pid_file": "/tmp/x.pid", "secrets": {},
    }  # fmt: skip
    return LaunchVm(**(fields | changes))  # type: ignore[arg-type]


def encode_args(request: LaunchVm) -> dict[str, object]:
    return dict(json.loads(encode(1, request))["args"])


def test_a_request_goes_through_the_wire_unchanged() -> None:
    request = _launch(binds=[("/a", "ro")], secrets={"disk": "k"}, netns="sp000000-000000")
    assert decode(encode(7, request)) == (7, request)


@pytest.mark.parametrize(
    "message",
    [
        {"id": 1, "op": "run_anything", "args": {}},
        {"id": 1, "op": "mount_pool", "args": {"image": "/a", "mountpoint": "/b"}},
        {"id": 1, "op": "mount_pool", "args": {"image": "/a", "mountpoint": "/b", "mkfs": 1}},
        {"id": 1, "op": "delete_subvolume", "args": {"path": "/a", "extra": "x"}},
        {"id": 1, "op": "delete_subvolume", "args": {"path": ["/a"]}},
        {"id": 1, "op": "delete_subvolume", "args": {"path": "/a\0b"}},
        {"id": "1", "op": "delete_subvolume", "args": {"path": "/a"}},
        {"id": 1, "op": "limit_subvolume", "args": {"path": "/a", "max_referenced": True}},
        {"id": 1, "op": "launch_vm", "args": {**encode_args(_launch()), "binds": [["/a"]]}},
        {"id": 1, "op": "launch_vm", "args": {**encode_args(_launch()), "secrets": {"a": 1}}},
        {"id": 1, "op": "launch_vm", "args": {**encode_args(_launch()), "argv": ["x"] * 513}},
        {"op": "sweep_vms", "args": {}},
        [1, 2],
    ],
)
def test_negative_a_line_outside_the_request_set_is_refused(message: object) -> None:
    with pytest.raises(RequestError):
        decode(json.dumps(message).encode())


def test_negative_an_oversized_line_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(RequestError, match="over"):
        decode(b"x" * (MAX_LINE_BYTES + 1))


def _refused(broker: RootBroker, request: object, match: str) -> None:
    async def ask() -> None:
        await broker.call(request)  # type: ignore[arg-type]

    with pytest.raises(InvalidArgument, match=match):
        asyncio.run(ask())


@pytest.mark.parametrize(
    "request_",
    [
        DeleteSubvolume(path="/etc"),
        DeleteSubvolume(path="/"),
        LimitSubvolume(path="/var", max_referenced=1 << 20),
        MountPool(image="/etc/shadow", mountpoint="/mnt", mkfs=True),
        StopGateways(directory="/proc"),
    ],
)
def test_negative_a_path_outside_the_nodes_directories_is_refused(
    broker: RootBroker, request_: object
) -> None:
    _refused(broker, request_, "outside this node's directories")
    assert Path("/etc/shadow").exists() and Path("/etc").is_dir()


def test_negative_a_path_that_escapes_by_dots_or_a_link_is_refused(
    broker: RootBroker, tmp_path: Path
) -> None:
    root, outside = tmp_path / "node", tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "kept").write_text("x")
    (root / "link").symlink_to(outside)
    _refused(broker, DeleteSubvolume(path=f"{root}/../outside"), "not a normal path")
    _refused(broker, DeleteSubvolume(path=f"{root}/link"), "is a link")
    _refused(broker, DeleteSubvolume(path=f"{root}/link/sub"), "link is a link")
    _refused(broker, LimitSubvolume(path=f"{root}/link/sub", max_referenced=1 << 20), "a link")
    _refused(broker, DeleteSubvolume(path=str(root)), "outside")  # the root itself
    assert (outside / "sub" / "kept").exists() and root.is_dir()


def test_negative_a_link_put_in_a_checked_paths_place_leads_root_nowhere(tmp_path: Path) -> None:
    """What root acts on is what was checked: a directory of the path swapped for a
    link to a root-owned tree after the check leaves that tree untouched."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "secret").write_text("root's")
    os.chmod(victim / "secret", 0o600)
    run_dir = tmp_path / "node" / "vm"
    run_dir.mkdir(parents=True)
    (run_dir / "disk").write_text("the VM's")
    disk = pin(str(run_dir / "disk"))
    pid_file = pin_parent(str(run_dir / "vm.pid"))
    try:
        run_dir.rename(tmp_path / "node" / "moved")
        run_dir.symlink_to(victim)
        (tmp_path / "node" / "moved" / "vm.pid").symlink_to(victim / "secret")
        share_held(disk.fd, JAIL_UIDS[3], 4343)
        os.chown(pid_file.path, 4343, 4343, follow_symlinks=False)  # as a launch does
        with pytest.raises(OSError):
            os.open(pid_file.path, os.O_RDONLY | os.O_NOFOLLOW)
    finally:
        disk.close()
        pid_file.close()
    moved = tmp_path / "node" / "moved" / "disk"
    assert (moved.stat().st_uid, moved.stat().st_gid) == (JAIL_UIDS[3], 4343)
    secret = (victim / "secret").stat()
    assert (secret.st_uid, secret.st_gid, secret.st_mode & 0o777) == (0, 0, 0o600)
    assert (victim / "secret").read_text() == "root's"
    with pytest.raises(InvalidArgument, match="is a link"):
        pin(str(run_dir / "disk"))  # asked anew, the link is seen


def test_negative_another_nodes_or_the_hosts_namespace_is_refused(broker: RootBroker) -> None:
    for name in ("sp000000-abcdef", "default", "init", netns_name_of(broker) + "0", "../x"):
        _refused(broker, SetEgress(name=name, open=True), "not a namespace of this node")
        _refused(broker, BindListeners(name=name), "not a namespace of this node")
    assert not any(netns.exists(n) for n in ("sp000000-abcdef", "default"))


def test_negative_a_jail_gets_no_device_and_no_file_of_the_host(
    broker: RootBroker, tmp_path: Path
) -> None:
    log, pid = str(tmp_path / "node/vm.log"), str(tmp_path / "node/vm.pid")
    for binds, match in (
        ([("/dev/sda", "dev")], "a bind is ro, rw or one of the devices"),
        ([("/etc/shadow", "ro")], "outside"),
        ([("/root", "rw")], "outside"),
    ):
        _refused(broker, _launch(binds=binds, stderr_log=log, pid_file=pid), match)
    _refused(broker, _launch(owned=["/etc/passwd"], stderr_log=log, pid_file=pid), "outside")
    _refused(broker, _launch(name="../x", stderr_log=log, pid_file=pid), "not a VM's name")
    assert os.stat("/etc/passwd").st_uid == 0
    assert not Path(pid).exists()


def test_negative_the_gateway_gets_no_secret_file_as_its_upstream_ca(
    broker: RootBroker, tmp_path: Path
) -> None:
    directory = tmp_path / "node" / "egress"
    request = StartGateway(
        directory=str(directory), state=[], options=[], upstream_ca="/etc/shadow", environment={}
    )
    _refused(broker, request, "not world-readable")
    assert not directory.exists()


def test_the_broker_makes_a_namespace_and_hands_its_listeners_to_the_node(
    broker: RootBroker,
) -> None:
    name = netns_name_of(broker)

    async def scenario() -> list[tuple[str, int]]:
        await broker.call(CreateNetns(name=name))
        try:
            _, fds = await broker.call_with_fds(BindListeners(name=name))
            sockets = [socket.socket(fileno=fd) for fd in fds]
            try:
                return [s.getsockname() for s in sockets]
            finally:
                for s in sockets:
                    s.close()
        finally:
            await netns.delete(broker.scope.run_root, name)

    assert asyncio.run(scenario()) == [
        (netns.GATEWAY_ADDRESS, netns.PROXY_PORT),
        (netns.GATEWAY_ADDRESS, netns.DNS_PORT),
    ]
    assert not netns.exists(name)


def _ip(namespace: str, *argv: str) -> str:
    return subprocess.run(
        ["ip", "-n", namespace, "-o", *argv], capture_output=True, text=True, check=True
    ).stdout


def test_a_gvisor_guest_s_link_is_a_veth_into_a_namespace_of_its_own(
    broker: RootBroker,
) -> None:
    """The guest's end (``eth0``, the guest's address and MAC, its one route to the
    gateway) alone in the second namespace; the other end, ``tap0``, in the sandbox's,
    where what the guest sends meets the ruleset as a VM's packets do: opened, a
    connection to anywhere lands on the gateway's listener. Made again whole if half of
    it is gone; deleted whole."""
    name = netns_name_of(broker)
    guest = netns.guest_netns(name)
    create = CreateNetns(name=name, veth=True)

    async def connect_through_the_gateway() -> str:
        _, fds = await broker.call_with_fds(BindListeners(name=name))
        tcp, udp = (socket.socket(fileno=fd) for fd in fds)
        try:
            await broker.call(SetEgress(name=name, open=True))
            connect = "import socket; socket.create_connection(('198.51.100.7', 80), 5)"
            client = await asyncio.create_subprocess_exec(
                "ip", "netns", "exec", guest, "python3", "-c", connect
            )
            tcp.settimeout(10)
            accepted, peer = await asyncio.to_thread(tcp.accept)
            accepted.close()
            assert await client.wait() == 0
            return str(peer[0])
        finally:
            tcp.close()
            udp.close()

    asyncio.run(broker.call(create))
    try:
        asyncio.run(broker.call(create))  # a no-op: both are there
        assert netns.GUEST_ADDRESS in _ip(guest, "address", "show", "dev", "eth0")
        assert netns.GUEST_MAC in _ip(guest, "link", "show", "dev", "eth0")
        assert _ip(guest, "route").split()[:3] == ["default", "via", netns.GATEWAY_ADDRESS]
        assert "veth" in _ip(name, "-d", "link", "show", "dev", netns.TAP)
        assert [line.split()[1] for line in _ip(name, "link").splitlines()] == [
            "lo:",
            f"{netns.TAP}@if{_ifindex(guest)}:",
        ]
        assert asyncio.run(connect_through_the_gateway()) == netns.GUEST_ADDRESS
        subprocess.run(["ip", "netns", "delete", guest], check=True)
        assert netns.node_netns(broker.scope.run_root) == [name]
        asyncio.run(broker.call(create))
        assert netns.GUEST_ADDRESS in _ip(guest, "address", "show", "dev", "eth0")
    finally:
        asyncio.run(netns.delete(broker.scope.run_root, name))
    assert not netns.exists(name) and not netns.exists(guest)


def _ifindex(namespace: str) -> str:
    return _ip(namespace, "link", "show", "dev", "eth0").split(":")[0]


def test_the_namespaces_directory_is_one_the_node_agent_may_list(tmp_path: Path) -> None:
    """/run/netns made, or found made, under a root server's umask (077) is opened to
    0755 before a namespace goes in: the agent, unprivileged, lists its own there."""
    made, found = tmp_path / "made", tmp_path / "found"
    found.mkdir(0o700)
    old = os.umask(0o077)
    try:
        for directory in (made, found):
            readable_directory(directory)
            assert stat.S_IMODE(directory.stat().st_mode) == 0o755
    finally:
        os.umask(old)
    readable_directory(found)  # idempotent
    assert stat.S_IMODE(found.stat().st_mode) == 0o755


def test_a_broker_that_died_is_started_again_and_runs_with_the_minimal_environment(
    broker: RootBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPACE_MASTER_KEY", "never-inherited")
    first = broker._proc
    assert first is not None
    first.kill()
    first.wait()

    async def scenario() -> None:
        with pytest.raises(NodeError):
            await broker.call(SetEgress(name="sp000000-abcdef", open=True))

    asyncio.run(scenario())  # refused by a new broker: it answered
    assert broker._proc is not None and broker._proc.pid != first.pid
    environ = Path(f"/proc/{broker._proc.pid}/environ").read_bytes().split(b"\0")
    assert not any(b"SPACE_MASTER_KEY" in entry for entry in environ)


def test_a_file_handed_to_a_jail_stays_in_the_agents_group_and_a_link_gets_nothing(
    tmp_path: Path,
) -> None:
    uid, group = JAIL_UIDS[7], 4343
    disk, run_dir = tmp_path / "disk", tmp_path / "run"
    disk.write_bytes(b"x")
    disk.chmod(0o600)
    run_dir.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to("/etc/passwd")
    for path in (disk, run_dir):
        share(path, uid, group)
    assert (disk.stat().st_uid, disk.stat().st_gid, disk.stat().st_mode & 0o7777) == (
        uid,
        group,
        0o660,
    )
    assert run_dir.stat().st_mode & 0o7777 == 0o2770  # sockets made in it join the group
    with pytest.raises(OSError):
        share(tmp_path / "link", uid, group)
    passwd = os.stat("/etc/passwd")
    assert (passwd.st_uid, passwd.st_gid, passwd.st_mode & 0o777) == (0, 0, 0o644)


def test_a_call_after_every_task_was_cancelled_is_still_answered(broker: RootBroker) -> None:
    """asyncio.run's end (``space serve`` on SIGTERM) cancels every task, the broker's
    reader too, and the cleanups that run then still call the broker (a VM's release):
    each waited the whole request timeout (660 s), and ``space serve`` with them."""

    async def scenario() -> None:
        with pytest.raises(NodeError):  # a first call: the reader runs
            await broker.call(SetEgress(name="sp000000-abcdef", open=True))
        reader = broker._reader_task
        assert reader is not None
        reader.cancel()
        await asyncio.wait({reader})
        async with asyncio.timeout(10):
            with pytest.raises(NodeError, match="set_egress"):  # the broker's own answer
                await broker.call(SetEgress(name="sp000000-abcdef", open=True))

    asyncio.run(scenario())
