"""A real embedded platform for end-to-end tests: `space serve` in a subprocess, and
more node agents (`space node`) registered with it.

The platform owns its data directory (SQLite, btrfs pool on a loop file, VM state) and
its teardown verifies that nothing is left: no QEMU process, no mount, no loop device;
so does each node agent's (``remote_node``) for its own.
"""

from __future__ import annotations

import base64
import contextlib
import os
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from space.node.agent.node_user import DEFAULT_USER
from space.node.network.gateway_client import running_gateways

from .. import logs
from ..ports import free_port

SPACE = [str(Path(sys.executable).parent / "space")]
READY_TIMEOUT_S = 240.0


@dataclass
class Platform:
    data_dir: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    #: More `space serve` options (egress resolvers and the like).
    extra_args: list[str] = field(default_factory=list)
    #: Variables added to this process's environment for `space serve` (a master key...).
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        let_through(self.data_dir.parent)
        with (self.data_dir / "serve.log").open("ab") as log:
            self.process = subprocess.Popen(
                [
                    *SPACE,
                    "serve",
                    "--data-dir",
                    str(self.data_dir),
                    "--port",
                    str(self.port),
                    *self.extra_args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.extra_env} if self.extra_env else None,
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"space serve exited early:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/openapi.json", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"space serve not ready in {READY_TIMEOUT_S} s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def create_key(self, tenant: str) -> str:
        out = subprocess.run(
            [*SPACE, "keys", "create", "--tenant", tenant, "--data-dir", str(self.data_dir)],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out.stdout.strip().splitlines()[-1]

    def log_tail(self, lines: int = 40) -> str:
        path = self.data_dir / "serve.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def let_through(directory: Path) -> None:
    """Let every user search (not list) ``directory`` and the directories above it:
    the server's node agent runs as its own user (issue 18), and pytest's temporary
    directories are root's alone."""
    for path in (directory, *directory.parents):
        mode = path.stat().st_mode
        if not mode & 0o001:
            path.chmod(mode & 0o7777 | 0o001)


def qemu_pids(data_dir: Path) -> list[int]:
    """QEMU processes whose command line mentions this data directory."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes()
            if b"qemu-system" in cmdline and str(data_dir).encode() in cmdline:
                pids.append(int(entry.name))
    return pids


def processes_naming(text: str) -> list[int]:
    """Processes (but this one) whose command line mentions ``text`` (a directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def gateway_pids(data_dir: Path) -> list[int]:
    """Egress gateway processes serving ``data_dir`` (their working directory is its
    ``egress``); they outlive the node agent, as QEMU does."""
    return running_gateways(data_dir / "egress")


def mounts_under(path: Path) -> list[str]:
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(str(path))]


def loops_backed_by(path: Path) -> list[str]:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=False).stdout
    return [line.split(":")[0] for line in out.splitlines() if str(path) in line]


#: An autoclear loop device goes at its last close, which may be udev's probe of it a
#: moment after the unmount (seen under load: a device listed just after a clean stop).
LOOP_SETTLE_S = 10.0


def settled(read: Callable[[], list[str]], within_s: float = LOOP_SETTLE_S) -> list[str]:
    """What ``read`` still lists once it had ``within_s`` to empty."""
    deadline = time.monotonic() + within_s
    while (left := read()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def release(data_dir: Path) -> list[str]:
    """Kill, unmount and detach whatever is left under data_dir; say what was left."""
    left = []
    for pid in qemu_pids(data_dir):
        left.append(f"qemu pid {pid}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in gateway_pids(data_dir):
        left.append(f"egress gateway pid {pid}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for mount in sorted(mounts_under(data_dir), reverse=True):
        subprocess.run(["umount", "-l", mount], check=False)
    for loop in loops_backed_by(data_dir):
        subprocess.run(["losetup", "-d", loop], check=False)
    return left


@contextlib.contextmanager
def running_platform(
    data_dir: Path, extra_args: list[str] | None = None, extra_env: dict[str, str] | None = None
) -> Iterator[Platform]:
    logs.register(data_dir)
    platform = Platform(data_dir, extra_args=extra_args or [], extra_env=extra_env or {})
    try:
        platform.start()
        yield platform
    finally:
        platform.stop()
        leaked = release(data_dir)
        assert not leaked, f"left behind after the platform stopped: {leaked}"
        assert not mounts_under(data_dir), "mounts left behind"
        assert not settled(lambda: loops_backed_by(data_dir)), "loop devices left behind"


@dataclass
class NodeAgent:
    """A `space node` process on loopback, registered with a platform; ``kill`` and
    ``start`` play a crash and a restart (the same options, the same data dir)."""

    data_dir: Path
    command: list[str]
    process: subprocess.Popen[bytes] | None = None
    node_id: str = ""

    def start(self) -> None:
        """Start it and wait until it registered."""
        log_path = self.data_dir / "node.log"
        begin = log_path.stat().st_size if log_path.exists() else 0
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while b"registered with" not in log_path.read_bytes()[begin:]:
            assert self.process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "node did not register in time"
            time.sleep(0.2)
        self.node_id = (self.data_dir / "node_id").read_text().strip()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the agent alone (``SIGKILL``: its VMs and root broker are left as a
        crash leaves them) and reap it."""
        if self.process is not None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
            self.process = None


@contextlib.contextmanager
def remote_node(
    platform: Platform, data_dir: Path, extra_args: list[str] | None = None
) -> Iterator[NodeAgent]:
    """Run `space node` on loopback, registered with ``platform`` (``extra_args``: more
    of its options); yield it once registered. On exit it is stopped and its data dir
    checked clean (no QEMU, gateway, mount or loop device left)."""
    data_dir.mkdir(parents=True)
    logs.register(data_dir)
    command = [
        *SPACE, "node", "--control-url", platform.url,
        "--token-file", str(platform.data_dir / "node-token"),
        "--listen", f"127.0.0.1:{free_port()}", "--data-dir", str(data_dir),
        *(extra_args or []),
    ]  # fmt: skip
    agent = NodeAgent(data_dir, command)
    try:
        agent.start()
        yield agent
    finally:
        agent.kill(signal.SIGTERM)
        leaked = release(data_dir)
        assert not leaked, f"left behind by the node agent in {data_dir}: {leaked}"
        assert not mounts_under(data_dir), "mounts left behind"
        assert not settled(lambda: loops_backed_by(data_dir)), "loop devices left behind"


def shared_node_key(directory: Path) -> Path:
    """A new node key file in the new ``directory``, for node agents that must share
    one (``--node-key-file``: a sandbox moves only between nodes of one key, issue 19).
    It is the agents' user's alone: they read it after they drop root."""
    user = pwd.getpwnam(DEFAULT_USER)
    directory.mkdir(mode=0o700)
    key_file = directory / "node.key"
    key_file.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    key_file.chmod(0o600)
    for path in (directory, key_file):
        os.chown(path, user.pw_uid, user.pw_gid)
    let_through(directory.parent)
    return key_file
