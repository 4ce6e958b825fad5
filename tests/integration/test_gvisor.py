"""gVisor sandboxes on a real node (issue 21): runsc, a btrfs clone of the base
image's tree, the sandbox's own network namespace; create, exec, files, egress denied
without a policy (with one: tests/integration/test_egress.py and the red team run on
gVisor too), what is refused so far, and delete leaving nothing behind (what goes
through saved memory: test_gvisor_lifecycle.py).

Its node makes no ready state (no QEMU boots here): gVisor sandboxes need none.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from space.node.agent import Node
from space.node.api import (
    ExecExited,
    ExecOutput,
    ExecRequest,
    InvalidArgument,
    SandboxSpec,
    SandboxState,
    Unavailable,
)
from space.node.core.config import NodeConfig
from space.node.network import netns
from space.node.privileged._gvisor import ROOTFS, TREE_ROOT
from space.node.vmm.gvisor import CHANNEL_SOCKET, runsc_home
from space.node.vmm.gvisor_tree import ensure_tree
from tests import logs
from tests.egress_guest import PROBE, assert_no_answer

from .conftest import NodeHarness, started_node
from .platform import processes_naming

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def gvisor_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeHarness]:
    if os.geteuid() != 0:
        pytest.fail("gVisor sandboxes need root (runsc, btrfs, namespaces): run as root")
    data_dir = tmp_path_factory.mktemp("gvisor-node")
    logs.register(data_dir)
    config = NodeConfig(
        data_dir=data_dir, pool_size_gib=8, ready_state=False, guest_without_kvm="gvisor"
    )
    with started_node(config) as harness:
        yield harness


#: A DNS query on a connected UDP socket to the gateway, which hears an ICMP error.
_UDP_TO_GATEWAY = """
import socket
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.settimeout(5)
sock.connect(("192.0.2.1", 53))
sock.send(b"query")
sock.recv(512)
"""


def _run(h: NodeHarness, sandbox_id: str, request: ExecRequest) -> tuple[str, str, int | None]:
    async def collect() -> tuple[str, str, int | None]:
        out, err, code = b"", b"", None
        async for event in await h.node.exec(sandbox_id, request):
            if isinstance(event, ExecOutput):
                if event.stream == "stdout":
                    out += event.data
                else:
                    err += event.data
            elif isinstance(event, ExecExited):
                code = event.exit_code
        return out.decode(), err.decode(), code

    return h.run(collect())


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _read(h: NodeHarness, sandbox_id: str, path: str) -> bytes:
    async def read() -> bytes:
        reader = await h.node.read_file(sandbox_id, path)
        try:
            return b"".join([chunk async for chunk in reader])
        finally:
            await reader.aclose()

    return h.run(read())


def _runsc_processes(bundle: Path) -> list[int]:
    marker = f"--bundle={bundle}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def _leftovers(h: NodeHarness, sandbox_id: str) -> list[str]:
    """Everything of a gVisor sandbox that must be gone after its deletion."""
    run_root = h.config.effective_run_dir
    home = runsc_home(run_root)
    bundle = home / "bundles" / sandbox_id
    left = [f"runsc pid {pid}" for pid in _runsc_processes(bundle)]
    relay = run_root / sandbox_id / CHANNEL_SOCKET
    left += [f"channel relay pid {pid}" for pid in processes_naming(str(relay))]
    state = home / "state"
    if state.is_dir():
        left += [f"runsc state {p.name}" for p in state.iterdir() if sandbox_id in p.name]
    name = netns.netns_name(run_root / sandbox_id)
    cgroup = f"{netns.node_prefix(run_root)}gv-{sandbox_id}"
    left += [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{cgroup}")]
    left += [str(p) for p in Path("/sys/fs/cgroup").glob(cgroup)]
    for path in (
        bundle,
        h.config.data_dir / "pool" / "sandboxes" / sandbox_id,
        h.config.data_dir / "sandboxes" / f"{sandbox_id}.json",
        run_root / sandbox_id,
        netns.netns_path(name),
        netns.netns_path(netns.guest_netns(name)),
    ):
        if path.exists():
            left.append(str(path))
    # The node is this process: runsc's orphans are its children, to be reaped.
    return left + [f"zombie runsc process {pid}" for pid in _runsc_zombies()]


def _runsc_zombies() -> list[int]:
    """This process's exited children named ``exe`` (runsc's), not reaped."""
    me, found = str(os.getpid()), []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            status = dict(
                line.split(":\t", 1) for line in (entry / "status").read_text().splitlines()
            )
            if (status["Name"], status["State"][:1], status["PPid"]) == ("exe", "Z", me):
                found.append(int(entry.name))
    return found


def test_node_offers_gvisor_and_resolves_auto(gvisor_node: NodeHarness) -> None:
    h = gvisor_node
    assert h.run(h.node.info()).guest_types == ["qemu", "gvisor"]
    # This node has no KVM and its config picks gvisor for ``auto``.
    status = h.run(h.node.create_sandbox(SandboxSpec("gv-auto", guest="auto")))
    try:
        assert status.guest == "gvisor"
        assert status.state == SandboxState.RUNNING
    finally:
        h.run(h.node.delete_sandbox("gv-auto"))
    assert _leftovers(h, "gv-auto") == []


def test_gvisor_sandbox_exec_files_egress_and_delete(gvisor_node: NodeHarness) -> None:
    h = gvisor_node
    spec = SandboxSpec("gv-basic", guest="gvisor", memory_mib=256, env={"GREETING": "hello"})
    status = h.run(h.node.create_sandbox(spec))
    try:
        assert (status.state, status.guest) == (SandboxState.RUNNING, "gvisor")
        assert status.vmm_pid is not None and Path(f"/proc/{status.vmm_pid}").exists()
        # runsc is given the volume bind-mounted into its root-only bundle, never a
        # path in the agent's pool it would look up again.
        bundle = runsc_home(h.config.effective_run_dir) / "bundles" / "gv-basic"
        assert json.loads((bundle / "config.json").read_text())["root"]["path"] == ROOTFS
        assert os.path.ismount(bundle / ROOTFS)

        # exec: streams, exit code, env, the sandbox's user; gVisor's kernel answers.
        out, err, code = _run(
            h, "gv-basic", ExecRequest(cmd='echo "$GREETING"; echo oops >&2; id -u; exit 3')
        )
        assert (out, err, code) == ("hello\n1000\n", "oops\n", 3)
        out, _, code = _run(h, "gv-basic", ExecRequest(argv=["dmesg"], user="root"))
        assert code == 0 and "gVisor" in out
        out, _, _ = _run(h, "gv-basic", ExecRequest(argv=["hostname"]))
        assert out.strip() == "gv-basic"

        # files: write, read back, list; the guest sees what was written.
        data = os.urandom(300_000)
        h.run(h.node.write_file("gv-basic", "/home/user/blob.bin", _chunks(data)))
        assert _read(h, "gv-basic", "/home/user/blob.bin") == data
        names = {entry.name for entry in h.run(h.node.list_dir("gv-basic", "/home/user"))}
        assert "blob.bin" in names
        out, _, code = _run(h, "gv-basic", ExecRequest(argv=["sha256sum", "/home/user/blob.bin"]))
        assert code == 0 and len(out.split()[0]) == 64
        # The guest's writes land in its own btrfs volume, owned as in the guest.
        volume = h.config.data_dir / "pool" / "sandboxes" / "gv-basic"
        guest_root = volume / TREE_ROOT
        assert (guest_root / "home" / "user" / "blob.bin").read_bytes() == data
        assert (guest_root / "home" / "user" / "blob.bin").stat().st_uid == 1000

        # egress: no policy, no network; the namespace's ruleset drops what leaves.
        probe = PROBE.read_bytes()
        h.run(h.node.write_file("gv-basic", "/tmp/probe.py", _chunks(probe)))
        for attempt in (
            {"kind": "tcp", "address": "198.51.100.7", "port": 80},
            {"kind": "udp", "address": "198.51.100.7", "port": 53},
            {"kind": "tcp", "address": "192.0.2.1", "port": 15001},
            {"kind": "dns", "name": "example.com"},
        ):
            out, err, _ = _run(
                h, "gv-basic", ExecRequest(argv=["python3", "/tmp/probe.py", json.dumps(attempt)])
            )
            assert_no_answer(json.loads(out))
        # Refused, not dropped, so a resolver gives up at once: gVisor's stack ignores
        # an ICMP admin-prohibited for UDP (a lookup then waited out its timeouts, 8 s).
        out, err, code = _run(h, "gv-basic", ExecRequest(argv=["python3", "-c", _UDP_TO_GATEWAY]))
        assert code == 1 and "ConnectionRefusedError" in err, err
        name = netns.netns_name(h.config.effective_run_dir / "gv-basic")
        rules = ruleset_of(name)
        assert "hook output priority filter; policy drop;" in rules

        # Its link is gVisor's own stack's (the host kernel has no socket of it), and
        # a policy opens it later as a VM's: the namespace's ruleset then sends what
        # arrives on tap0 to the gateway.
        out, _, code = _run(h, "gv-basic", ExecRequest(argv=["cat", "/proc/net/dev"]))
        assert code == 0 and "eth0:" in out
        h.run(h.node.set_egress("gv-basic", {"allow": [{"domain": "example.com"}]}))
        rules = ruleset_of(name)
        assert f'iifname "tap0" meta l4proto tcp redirect to :{netns.PROXY_PORT}' in rules
        h.run(h.node.set_egress("gv-basic", None))
        assert h.run(h.node.get_sandbox("gv-basic")).state == SandboxState.RUNNING
    finally:
        h.run(h.node.delete_sandbox("gv-basic"))
    assert _leftovers(h, "gv-basic") == []


def ruleset_of(netns_name: str) -> str:
    """The nftables ruleset in the namespace ``netns_name``, as nft lists it."""
    return subprocess.run(
        ["ip", "netns", "exec", netns_name, "nft", "list", "table", "inet", "space"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def _parents_and_states(h: NodeHarness, sandbox_id: str, pids: list[str]) -> list[str]:
    """Each of ``pids`` in the sandbox as "PPID STATE", or "gone" (reaped)."""
    script = (
        f"for p in {' '.join(pids)}; do"
        " if read -r line < /proc/$p/stat 2>/dev/null;"
        ' then set -- ${line##*) }; echo "$2 $1"; else echo gone; fi; done'
    )
    out, _, code = _run(h, sandbox_id, ExecRequest(cmd=script, user="root"))
    assert code == 0, out
    return out.splitlines()


def test_orphans_are_reaped_by_spaced_as_the_sandbox_s_init(gvisor_node: NodeHarness) -> None:
    """An agent's ``nohup job &`` from a shell that exits leaves an orphan; PID 1 must
    wait for it, or a long session fills the sandbox with zombies."""
    h = gvisor_node
    h.run(h.node.create_sandbox(SandboxSpec("gv-orphans", guest="gvisor")))
    try:
        pids = []
        for _ in range(3):  # each shell exits at once; its sleep, in a session of its
            # own (out of reach of the exec's end), goes on as an orphan
            orphan = "setsid sleep 600 >/dev/null 2>&1 & echo $!"
            out, _, code = _run(h, "gv-orphans", ExecRequest(cmd=orphan))
            assert code == 0
            pids.append(out.strip())
        # Each is PID 1's (spaced's) child, sleeping once its exec is done.
        deadline = time.monotonic() + 30
        while (seen := _parents_and_states(h, "gv-orphans", pids)) != ["1 S"] * 3:
            assert time.monotonic() < deadline, seen
            time.sleep(0.2)
        assert _run(h, "gv-orphans", ExecRequest(cmd=f"kill {' '.join(pids)}"))[2] == 0
        # Killed, each is reaped: no zombie ("1 Z") is left.
        deadline = time.monotonic() + 30
        while (seen := _parents_and_states(h, "gv-orphans", pids)) != ["gone"] * 3:
            assert time.monotonic() < deadline, seen
            time.sleep(0.2)
    finally:
        h.run(h.node.delete_sandbox("gv-orphans"))


def test_gvisor_refusals(gvisor_node: NodeHarness) -> None:
    h = gvisor_node
    with pytest.raises(InvalidArgument, match="guest must be one of"):
        h.run(h.node.create_sandbox(SandboxSpec("gv-bad", guest="firecracker")))
    assert _leftovers(h, "gv-bad") == []


def test_negative_a_link_in_the_way_of_a_tree_s_unpacking_leads_root_nowhere(
    gvisor_node: NodeHarness, tmp_path: Path
) -> None:
    """The agent's image is unpacked as root by names: a link the agent puts where
    the unpacking happens is refused, and nothing is written through it."""
    h = gvisor_node
    images = [
        p / "rootfs.img" for p in h.config.image_cache_dir.iterdir() if (p / "rootfs.img").is_file()
    ]
    trees = h.config.data_dir / "pool" / "gvisor"
    trees.mkdir(mode=0o700, exist_ok=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (trees / ".attack.unpacking").symlink_to(victim)
    try:
        with pytest.raises(Unavailable, match="not a directory of root's"):
            h.run(
                ensure_tree(h.config.effective_run_dir, trees / "attack", images[0], passphrase=b"")
            )
        assert list(victim.iterdir()) == [] and not (trees / "attack").exists()
    finally:
        (trees / ".attack.unpacking").unlink()
    # A scratch directory the broker left (root's alone) is taken up again.
    (trees / ".again.unpacking").mkdir(mode=0o700)
    h.run(ensure_tree(h.config.effective_run_dir, trees / "again", images[0], passphrase=b""))
    try:
        assert (trees / "again" / TREE_ROOT / "usr" / "bin" / "python3").exists()
        assert not (trees / ".again.unpacking").exists()
    finally:
        subprocess.run(["btrfs", "property", "set", "-ts", str(trees / "again"), "ro", "false"])
        subprocess.run(["btrfs", "subvolume", "delete", str(trees / "again")], check=True)


def test_a_gvisor_sandbox_no_record_claims_is_stopped_when_the_node_starts(
    gvisor_node: NodeHarness,
) -> None:
    """Its runsc and relay outlive the node, so one whose record is gone (lost, or
    never written) would run for ever: recovery stops it and removes what it had."""
    h = gvisor_node
    h.run(h.node.create_sandbox(SandboxSpec("gv-stray", guest="gvisor")))
    bundle = runsc_home(h.config.effective_run_dir) / "bundles" / "gv-stray"
    assert _runsc_processes(bundle)
    h.run(h.node.close())
    (h.config.data_dir / "sandboxes" / "gv-stray.json").unlink()
    h.node = h.run(Node.start(h.config))
    assert _leftovers(h, "gv-stray") == []
