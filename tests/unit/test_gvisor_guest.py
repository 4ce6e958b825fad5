"""The guest type of a sandbox (issue 21): what a spec may ask for, how ``auto``
resolves, that the choice is recorded, and that root starts a gVisor sandbox only of
the shape it decides itself, whatever the node agent asks."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from space.control.scheduler import rank_nodes
from space.control.schemas import SandboxCreate
from space.control.store.nodes import NodeRecord
from space.node.api import GUEST_CHOICES, InvalidArgument, SandboxSpec, SandboxState
from space.node.api.wire import decode
from space.node.core.config import NodeConfig
from space.node.core.state import SandboxRecord
from space.node.core.template import Template
from space.node.core.validation import check_spec, resolve_guest
from space.node.privileged import RootBroker
from space.node.privileged._gvisor import (
    GUEST_PROCESS,
    OVERHEAD_MIB,
    RESOLV_CONF,
    TREE_ROOT,
    oci_config,
)
from space.node.privileged.requests import (
    CheckpointGvisor,
    LaunchGvisor,
    MakeGuestTree,
    PauseGvisor,
    encode,
)
from space.node.privileged.requests import decode as decode_request
from space.node.storage.btrfs import TemplateVolume
from tests.root_broker import netns_name_of, root_broker

BOTH = ["qemu", "gvisor"]


def _template() -> Template:
    volume = TemplateVolume(name="base", digest="ab" * 32, path=Path("/nonexistent"))
    return Template("base", "latest", volume, "", min_disk_mib=1024, pristine=True)


def test_a_spec_asks_for_auto_unless_it_names_a_type() -> None:
    assert SandboxSpec("s").guest == "auto"
    assert GUEST_CHOICES == ("qemu", "gvisor", "auto")
    # Through the node's HTTP API the field arrives as sent.
    assert decode(SandboxSpec, {"sandbox_id": "s", "guest": "gvisor"}).guest == "gvisor"
    for guest in GUEST_CHOICES:
        check_spec(SandboxSpec("s", guest=guest), lambda _ref: _template())


@pytest.mark.parametrize("guest", ["", "xen", "QEMU", "gvisor ", "kvm"])
def test_negative_a_guest_type_outside_the_choices_is_refused(guest: str) -> None:
    with pytest.raises(InvalidArgument, match="guest must be one of qemu, gvisor, auto"):
        check_spec(SandboxSpec("s", guest=guest), lambda _ref: _template())


def test_auto_is_the_vm_where_kvm_works_and_the_nodes_choice_where_it_does_not() -> None:
    auto = SandboxSpec("s")
    assert resolve_guest(auto, kvm=True, without_kvm="gvisor", offered=BOTH) == "qemu"
    assert resolve_guest(auto, kvm=False, without_kvm="gvisor", offered=BOTH) == "gvisor"
    assert resolve_guest(auto, kvm=False, without_kvm="qemu", offered=BOTH) == "qemu"
    named = SandboxSpec("s", guest="gvisor")
    assert resolve_guest(named, kvm=True, without_kvm="qemu", offered=BOTH) == "gvisor"


def test_negative_a_type_the_node_does_not_offer_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="guest gvisor is not offered by this node"):
        resolve_guest(
            SandboxSpec("s", guest="gvisor"), kvm=False, without_kvm="qemu", offered=["qemu"]
        )
    with pytest.raises(InvalidArgument, match="not offered"):
        resolve_guest(SandboxSpec("s"), kvm=False, without_kvm="gvisor", offered=["qemu"])


def test_the_nodes_default_is_qemu_and_must_be_a_type(tmp_path: Path) -> None:
    assert NodeConfig(data_dir=tmp_path).guest_without_kvm == "qemu"
    for bad in ("auto", "xen"):
        with pytest.raises(InvalidArgument, match="guest_without_kvm must be one of"):
            NodeConfig(data_dir=tmp_path, guest_without_kvm=bad)


def test_the_resolved_type_is_recorded_and_old_records_are_qemus() -> None:
    record = SandboxRecord(
        spec=SandboxSpec("s", guest="auto"),
        state=SandboxState.RUNNING,
        created_at=1.0,
        template_digest="d",
        run_dir="/run/x/s",
        guest="gvisor",
    )
    again = SandboxRecord.from_json(record.to_json())
    assert (again.guest, again.spec.guest, again.status().guest) == ("gvisor", "auto", "gvisor")
    old = record.to_json()
    del old["guest"], old["spec"]["guest"]
    assert SandboxRecord.from_json(old).guest == "qemu"


def test_the_container_root_starts_is_spaced_on_kernel_file_systems_only() -> None:
    config = oci_config(
        rootfs="/pool/sandboxes/s", hostname="s", netns="sp000000-abcdef", cpus=2,
        memory_mib=512, cgroup="/sp000000-gv-s",
    )  # fmt: skip
    process = config["process"]
    assert isinstance(process, dict) and process["args"] == GUEST_PROCESS
    mounts = config["mounts"]
    assert isinstance(mounts, list)
    # One bind mount, read-only: the resolver file root writes into the bundle (a
    # relative source is the bundle's); nothing else of the host but its own volume.
    binds = [m for m in mounts if m["type"] == "bind"]
    assert binds == [
        {
            "destination": "/etc/resolv.conf",
            "type": "bind",
            "source": RESOLV_CONF,
            "options": ["bind", "ro"],
        }
    ]
    assert {m["type"] for m in mounts} - {"bind"} <= {"proc", "sysfs", "tmpfs", "devpts"}
    linux = config["linux"]
    assert isinstance(linux, dict)
    resources = linux["resources"]
    assert resources["memory"]["limit"] == (512 + OVERHEAD_MIB) << 20
    assert resources["cpu"] == {"quota": 200_000, "period": 100_000}
    assert {"type": "network", "path": "/run/netns/sp000000-abcdef"} in linux["namespaces"]
    closed = oci_config(
        rootfs="/pool/sandboxes/s", hostname="s", netns=None, cpus=1, memory_mib=256,
        cgroup="/sp000000-gv-s",
    )  # fmt: skip
    closed_mounts = closed["mounts"]
    assert isinstance(closed_mounts, list)
    assert all(m["type"] != "bind" for m in closed_mounts)


# what the node agent may ask of root


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RootBroker]:
    if os.geteuid() != 0:
        pytest.fail("the root broker needs root: run the suite as root")
    with root_broker(tmp_path / "node") as started:
        yield started


def _launch(broker: RootBroker, tmp_path: Path, **changes: object) -> LaunchGvisor:
    volume = tmp_path / "node" / "volume"
    (volume / TREE_ROOT).mkdir(parents=True, exist_ok=True)
    fields: dict[str, object] = {
        "name": "gv-1", "volume": str(volume), "netns": netns_name_of(broker),
        "hostname": "gv-1", "memory_mib": 256, "cpus": 1,
        "log": str(tmp_path / "node" / "gv-1.log"),
    }  # fmt: skip
    return LaunchGvisor(**(fields | changes))  # type: ignore[arg-type]


def _refused(broker: RootBroker, request: object, match: str, fds: tuple[int, ...]) -> None:
    async def ask() -> None:
        await broker.call(request, fds=fds)  # type: ignore[arg-type]

    with pytest.raises(InvalidArgument, match=match):
        asyncio.run(ask())


def test_the_gvisor_requests_go_through_the_wire_unchanged() -> None:
    request = LaunchGvisor("n", "/v", None, "h", 256, 1, "/l")
    assert decode_request(encode(3, request)) == (3, request)
    assert decode_request(encode(4, MakeGuestTree(path="/p"))) == (4, MakeGuestTree(path="/p"))
    for other in (
        LaunchGvisor("n", "/v", "ns", "h", 256, 1, "/l", restore=True, networked=True),
        PauseGvisor(name="n", paused=True),
        CheckpointGvisor(name="n"),
    ):
        assert decode_request(encode(5, other)) == (5, other)


def test_negative_root_launches_no_gvisor_sandbox_outside_its_scope(
    broker: RootBroker, tmp_path: Path
) -> None:
    ours, theirs = socket.socketpair()
    read_end, write_end = os.pipe()
    try:
        fd = (theirs.fileno(),)
        _refused(broker, _launch(broker, tmp_path), "takes one descriptor", ())
        _refused(broker, _launch(broker, tmp_path), "takes a socket", (read_end,))
        _refused(broker, _launch(broker, tmp_path, volume="/"), "outside this node's", fd)
        _refused(broker, _launch(broker, tmp_path, volume="/etc"), "outside this node's", fd)
        _refused(broker, _launch(broker, tmp_path, netns="default"), "not a namespace", fd)
        _refused(broker, _launch(broker, tmp_path, hostname="a b"), "not a host name", fd)
        _refused(broker, _launch(broker, tmp_path, name="../x"), "not a VM's name", fd)
        _refused(broker, _launch(broker, tmp_path, cpus=0), "within bounds", fd)
        _refused(broker, _launch(broker, tmp_path, memory_mib=1 << 30), "within bounds", fd)
        _refused(broker, MakeGuestTree(path="/etc/tree"), "outside this node's", (read_end,))
        _refused(broker, MakeGuestTree(path=str(tmp_path / "node" / "t")), "one descriptor", ())
        # A restore takes the channel and the state; a network needs a namespace.
        restore = _launch(broker, tmp_path, restore=True)
        _refused(broker, restore, "takes a socket and a state", fd)
        _refused(broker, restore, "takes a pipe or a file", (theirs.fileno(), ours.fileno()))
        no_netns = _launch(broker, tmp_path, netns=None, networked=True)
        _refused(broker, no_netns, "only inside a namespace", fd)
        # Pause and checkpoint name sandboxes by checked names and save to pipes or files.
        _refused(broker, PauseGvisor(name="../x", paused=True), "not a VM's name", ())
        _refused(broker, CheckpointGvisor(name="gv-1"), "one descriptor", ())
        _refused(broker, CheckpointGvisor(name="gv-1"), "takes a pipe or a file", fd)
        _refused(broker, CheckpointGvisor(name="../x"), "not a VM's name", (write_end,))
    finally:
        for sock in (ours, theirs):
            sock.close()
        os.close(read_end)
        os.close(write_end)
    assert not Path("/etc/tree").exists()
    assert not (tmp_path / "node" / "run" / ".runsc" / "bundles" / "gv-1").exists()


# the control plane's side


def _node(node_id: str, guest_types: list[str] | None) -> NodeRecord:
    capacity = None if guest_types is None else {"room": 1, "guest_types": guest_types}
    return NodeRecord(node_id, "u", "active", 1.0, 1.0, capacity)


def test_a_sandbox_asking_for_a_guest_type_is_placed_only_where_it_runs() -> None:
    nodes = [_node("vm-only", ["qemu"]), _node("both", ["qemu", "gvisor"]), _node("old", None)]
    ids = [n.id for n in nodes]
    assert rank_nodes(nodes, {}, reachable=ids, guest="gvisor") == ["both", "old"]
    assert rank_nodes(nodes, {}, reachable=ids, guest="qemu") == ["both", "old", "vm-only"]
    assert len(rank_nodes(nodes, {}, reachable=ids)) == 3  # auto: any


def test_the_create_body_takes_a_guest_choice_and_refuses_others() -> None:
    assert SandboxCreate.model_validate({}).guest == "auto"
    assert SandboxCreate.model_validate({"guest": "gvisor"}).guest == "gvisor"
    for bad in ("xen", "", "GVISOR"):
        with pytest.raises(ValidationError, match="guest must be one of qemu, gvisor, auto"):
            SandboxCreate.model_validate({"guest": bad})
