"""Several hosts on this machine, for issue 19's tests: node agents in network
namespaces, control-plane replicas on one PostgreSQL database.

A bridge in the host's namespace (10.213.0.1/24, the third byte the pytest-xdist
worker's number) is the LAN; each node host is a network namespace the test makes,
hanging off it by a veth pair (10.213.0.11, .12, ...), running `space node` (root, then
its own `space` user) with its own data directory, loop-file btrfs pool and VMs, and one
node key for all (``--node-key-file``: nodes that move sandboxes between them must share
it, issue 19). The replicas are `space control` processes on the host's end of the
bridge, each with its own data directory, sharing the database, the node token and the
master key; every node is told every replica's URL (no load balancer: it tries them in
turn). The node agents serve their API over HTTPS (one certificate for all, trusted by
every node and replica). Traffic stays on the bridge and in the namespaces. ``close``
kills every process, removes every namespace, link, mount and loop device it made, and
says what it had to clean, also when a test failed."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import pwd
import secrets
import signal
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509

from space.node.agent.node_user import DEFAULT_USER

from .. import logs
from ..tls import write_self_signed
from ..workers import xdist_worker
from .platform import (
    SPACE,
    let_through,
    loops_backed_by,
    mounts_under,
    processes_naming,
    release,
    settled,
    shared_node_key,
)

__all__ = ["Cluster", "NodeHost", "Replica", "cluster"]

#: Each pytest-xdist worker's clusters have their own LAN (tests/workers.py).
SUBNET = f"10.213.{xdist_worker()}"
BRIDGE_ADDRESS = f"{SUBNET}.1"
_READY_TIMEOUT_S = 300.0
#: Short enough that the tests see leases run out and jobs change hands in seconds.
REPLICA_OPTIONS = (
    "--reaper-interval", "1", "--node-heartbeat", "1", "--node-lease", "6",
    "--reconcile-interval", "3", "--reconcile-grace", "20",
)  # fmt: skip


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _log_tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


@dataclass
class Replica:
    """One `space control` process."""

    data_dir: Path
    port: int
    database_url: str
    token_file: Path
    master_key_file: Path
    #: The CA the node agents' https certificates are checked with.
    node_ca_file: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{BRIDGE_ADDRESS}:{self.port}"

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        logs.register(self.data_dir)
        command = [
            *SPACE, "control", "--data-dir", str(self.data_dir),
            "--listen", f"{BRIDGE_ADDRESS}:{self.port}",
            "--node-token-file", str(self.token_file),
            "--master-key-file", str(self.master_key_file), *REPLICA_OPTIONS,
            "--node-ca-file", str(self.node_ca_file),
        ]  # fmt: skip
        env = {**os.environ, "SPACE_DATABASE_URL": self.database_url}
        with (self.data_dir / "serve.log").open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"space control exited early:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/openapi.json", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"space control not ready:\n{self.log_tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None:
            self.process.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(timeout=10)
            self.process = None

    def log_tail(self) -> str:
        return _log_tail(self.data_dir / "serve.log")


@dataclass
class NodeHost:
    """A network namespace on the bridge, running `space node`."""

    index: int
    netns: str
    veth: str
    data_dir: Path
    #: The node key every node of the cluster shares.
    key_file: Path
    #: More `space node` options, the same at every start (the cluster's artifact store).
    options: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None
    node_id: str = ""
    #: Where this start's lines begin in its log (an earlier start's are before).
    _log_from: int = 0

    @property
    def address(self) -> str:
        return f"{SUBNET}.{10 + self.index}"

    @property
    def url(self) -> str:
        return f"https://{self.address}:8081"

    def start(self, replicas: list[Replica], token_file: Path, pool_size_gib: int = 8) -> None:
        """Start the node agent (``wait_registered`` waits for it)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        let_through(self.data_dir.parent)
        logs.register(self.data_dir)
        log_path = self.data_dir / "node.log"
        self._log_from = log_path.stat().st_size if log_path.exists() else 0
        controls = [arg for replica in replicas for arg in ("--control-url", replica.url)]
        command = [
            # nsenter, not `ip netns exec`: that one mounts a sysfs of the namespace over
            # /sys, without the cgroup2 mount the node makes its VMs' cgroups in.
            "nsenter", f"--net=/run/netns/{self.netns}", *SPACE, "node", *controls,
            "--token-file", str(token_file), "--listen", f"{self.address}:8081",
            "--data-dir", str(self.data_dir), "--pool-size-gib", str(pool_size_gib),
            "--node-key-file", str(self.key_file), *self.options,
        ]  # fmt: skip
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def wait_registered(self) -> None:
        log_path = self.data_dir / "node.log"
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while b"registered with" not in log_path.read_bytes()[self._log_from :]:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"space node exited early:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"space node did not register:\n{self.log_tail()}")
            time.sleep(0.3)
        self.node_id = (self.data_dir / "node_id").read_text().strip()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the node agent alone (its VMs and root broker are left as a crash
        leaves them)."""
        if self.process is not None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
            self.process = None

    def log_tail(self) -> str:
        return _log_tail(self.data_dir / "node.log")

    def release(self) -> list[str]:
        """Kill and unmount whatever of this host is left; say what was."""
        self.kill(signal.SIGTERM)
        left = release(self.data_dir)
        for pid in processes_naming(str(self.data_dir)):  # a root broker, a launcher
            left.append(f"process {pid}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if mounts_under(self.data_dir) or settled(lambda: loops_backed_by(self.data_dir)):
            left.append("mounts or loop devices")
        return left


@dataclass
class Cluster:
    root: Path
    database_url: str
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    replicas: list[Replica] = field(default_factory=list)
    hosts: list[NodeHost] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"spcbr{self.tag}"

    @property
    def token_file(self) -> Path:
        return self.root / "shared" / "node-token"

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def open(
        self,
        nodes: int,
        replicas: int,
        ports: list[int],
        pool_size_gib: int = 8,
        node_options: Callable[[], list[str]] | None = None,
    ) -> None:
        """Make the bridge, the namespaces, the replicas and the nodes; ``node_options``
        is asked, once the bridge is up, for more options of every node."""
        shared = self.root / "shared"
        shared.mkdir(parents=True, mode=0o700)
        self.token_file.write_text(secrets.token_urlsafe(32) + "\n")
        self.token_file.chmod(0o600)
        master_key = shared / "master.key"
        key_file = shared_node_key(self.root / "node-key")
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index in range(1, nodes + 1):
            host = NodeHost(
                index, f"spc-{self.tag}-n{index}", f"spv{self.tag}n{index}",
                self.root / f"node{index}", key_file,
            )  # fmt: skip
            self.hosts.append(host)
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns",
                host.netns)  # fmt: skip
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        # Every node's API over HTTPS (moves and template shipments stream through it),
        # one certificate for all their addresses, the CA every node and replica trusts.
        cert, key = _node_certificate(self.root / "node-tls", [h.address for h in self.hosts])
        tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--peer-ca-file", str(cert)]
        options = tls + ([] if node_options is None else node_options())
        for host in self.hosts:
            host.options = options
        for index in range(replicas):
            replica = Replica(
                self.root / f"control{index + 1}", ports[index], self.database_url,
                self.token_file, master_key, cert,
            )  # fmt: skip
            self.replicas.append(replica)
            replica.start()
        for host in self.hosts:  # in parallel: each prepares its template (a VM boot)
            host.start(self.replicas, self.token_file, pool_size_gib)
        for host in self.hosts:
            host.wait_registered()

    def create_key(self, tenant: str) -> str:
        out = subprocess.run(
            [*SPACE, "keys", "create", "--tenant", tenant, "--database", self.database_url,
             "--data-dir", str(self.replicas[0].data_dir)],
            check=True, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        return out.stdout.strip().splitlines()[-1]

    def node_api(self, host: NodeHost, path: str) -> Any:
        """GET a node agent's own API (``/node/v1/...``) with the node token."""
        headers = {"Authorization": f"Bearer {self.token}"}
        verify = ssl.create_default_context(cafile=str(self.root / "node-tls" / "node.crt"))
        url = f"{host.url}/node/v1/{path}"
        answer = httpx.get(url, headers=headers, timeout=30, verify=verify)
        answer.raise_for_status()
        return answer.json()

    def close(self) -> list[str]:
        left: list[str] = []
        for host in self.hosts:
            left += host.release()
        for replica in self.replicas:
            replica.kill(signal.SIGTERM)
        for host in self.hosts:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("link", "delete", host.veth)  # and its end in the namespace
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "delete", host.netns)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "delete", self.bridge)
        return left

    def leftovers(self) -> list[str]:
        """Links and namespaces of this cluster still there (the kernel removes a
        namespace's links a moment after the namespace: asked a few times)."""
        for _ in range(50):
            links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
            spaces = subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout
            left = [line for line in (links + spaces).splitlines() if self.tag in line]
            if not left:
                return []
            time.sleep(0.1)
        return left


def _node_certificate(directory: Path, addresses: list[str]) -> tuple[Path, Path]:
    """One certificate (its own CA) for every node address, and its key, in the new
    ``directory``: the key the node agents' user's alone (they load it after they
    drop root)."""
    agent = pwd.getpwnam(DEFAULT_USER)
    directory.mkdir(mode=0o755)
    cert, key = directory / "node.crt", directory / "node.key"
    names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    write_self_signed(cert, key, "space nodes", names, ca=True)
    os.chown(key, agent.pw_uid, agent.pw_gid)
    return cert, key


@contextlib.contextmanager
def cluster(
    root: Path,
    database_url: str,
    *,
    nodes: int,
    replicas: int,
    ports: list[int],
    pool_size_gib: int = 8,
    node_options: Callable[[], list[str]] | None = None,
) -> Iterator[Cluster]:
    """A Cluster, opened (``node_options`` as ``Cluster.open``); closed (and checked
    clean) on exit."""
    made = Cluster(root, database_url)
    try:
        made.open(nodes, replicas, ports, pool_size_gib, node_options)
        yield made
    finally:
        leaked = made.close()
        assert not made.leftovers(), f"links or namespaces left: {made.leftovers()}"
        assert not leaked, f"left behind: {leaked}"
