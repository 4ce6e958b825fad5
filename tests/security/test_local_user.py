"""Hostile local user (issue 18): an unprivileged uid on the node reads nothing of the
data dir, no process of the platform but the server holds the master key, and the
server itself runs as its own unprivileged user, root kept by its broker alone.

One `space serve` with SPACE_MASTER_KEY in its environment; a sandbox that was
snapshotted and hibernated (so a snapshot and a saved memory image exist on disk) and
one left running (so a live QEMU's environment can be read). The data dir lies under a
world-traversable directory, so it is its own mode that must refuse, not a parent's.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from space import Sandbox
from space.node.core.config import NodeConfig
from space.node.vmm.jail import JAIL_UIDS
from tests.integration.platform import Platform, gateway_pids, qemu_pids, running_platform
from tests.security.access_probe import errnos_as

pytestmark = pytest.mark.vm

NOBODY = 65534
MASTER_KEY = base64.b64encode(os.urandom(32)).decode()


# Run as uid/gid 65534 with no supplementary groups: try to list every directory and
# open every file named on stdin; print {path: errno or 0 when it worked}.
@pytest.fixture(scope="module")
def platform() -> Iterator[Platform]:
    # Not under pytest's tmp dirs: those are 0700 themselves and would hide the data
    # dir's own mode. This parent is 0755, as /var/lib is.
    parent = Path(tempfile.mkdtemp(prefix="space-local-user-", dir="/var/tmp"))
    parent.chmod(0o755)
    try:
        env = {"SPACE_MASTER_KEY": MASTER_KEY}
        with running_platform(parent / "data", extra_env=env) as p:
            yield p
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(scope="module")
def sandboxes(platform: Platform) -> Iterator[tuple[Sandbox, Sandbox]]:
    """One sandbox snapshotted then hibernated, one running."""
    key = platform.create_key("tenant-a")
    saved = Sandbox.create(api_url=platform.url, api_key=key, memory_mib=256)
    running = Sandbox.create(api_url=platform.url, api_key=key, memory_mib=256)
    try:
        saved.commands.run("echo secret-data > /root/data")
        saved.snapshot("kept")
        assert saved.hibernate().state == "hibernated"
        yield saved, running
    finally:
        for sandbox in (saved, running):
            with contextlib.suppress(Exception):
                sandbox.kill()


def _as_nobody(paths: list[str]) -> dict[str, int]:
    return errnos_as(NOBODY, NOBODY, paths)


def _everything_under(root: Path) -> list[str]:
    paths = [str(root)]
    for top, dirs, files in os.walk(root):
        paths += [os.path.join(top, name) for name in dirs + files]
    return paths


def test_an_unprivileged_user_can_open_or_list_nothing_in_the_data_dir(
    platform: Platform, sandboxes: tuple[Sandbox, Sandbox]
) -> None:
    data = platform.data_dir
    paths = _everything_under(data)
    names = {Path(p).name for p in paths}
    # What is at stake (no master.key: the key came from SPACE_MASTER_KEY).
    assert {"pool.img", "space.db", "node-token", "node.key"} <= names
    assert any(Path(p).name == "memory.ram" for p in paths), "no saved memory image to probe"
    # Control: the same uid lists the parent, so it does run and the refusals are real.
    assert _as_nobody([str(data.parent)]) == {str(data.parent): 0}
    refused = _as_nobody(paths)
    assert refused[str(data)] == errno.EACCES  # the top dir itself refuses
    assert {p: e for p, e in refused.items() if e != errno.EACCES} == {}
    assert oct(data.stat().st_mode & 0o777) == oct(0o700)
    # Nor the VMs' sockets (QMP, guest channels) under the node's run directory.
    run_root = NodeConfig(data_dir=data).effective_run_dir
    assert any(p.name == "qmp.sock" for p in run_root.rglob("*"))
    assert _as_nobody([str(run_root)]) == {str(run_root): errno.EACCES}


def _holding(value: str) -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if value.encode() in (proc / "environ").read_bytes():
                    pids.add(int(proc.name))
    return pids


def test_no_process_of_the_platform_but_the_server_holds_the_master_key(
    platform: Platform, sandboxes: tuple[Sandbox, Sandbox]
) -> None:
    assert platform.process is not None
    qemus, gateways = qemu_pids(platform.data_dir), gateway_pids(platform.data_dir)
    assert qemus and gateways  # the running sandbox's QEMU and the egress gateway
    for pid in [*qemus, *gateways]:
        assert b"SPACE_MASTER_KEY" not in Path(f"/proc/{pid}/environ").read_bytes(), pid
    assert _holding(MASTER_KEY) == {platform.process.pid}


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def test_the_node_agent_runs_as_its_own_user_and_only_its_broker_keeps_root(
    platform: Platform, sandboxes: tuple[Sandbox, Sandbox]
) -> None:
    assert platform.process is not None
    server = platform.process.pid
    space = pwd.getpwnam("space")
    status = _status(server)
    assert status["Uid"].split() == [str(space.pw_uid)] * 4
    assert status["Gid"].split() == [str(space.pw_gid)] * 4
    assert status["Groups"] == ""
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps], 16) == 0, caps
    assert status["NoNewPrivs"] == "1"
    # Its one root child is the broker; the VMs and the gateway are jailed uids.
    children = [
        int(p.name) for p in Path("/proc").iterdir()
        if p.name.isdigit() and _ppid(int(p.name)) == server
    ]  # fmt: skip
    rooted = [pid for pid in children if _status(pid)["Uid"].split()[0] == "0"]
    assert len(rooted) == 1
    assert b"space.node.privileged" in Path(f"/proc/{rooted[0]}/cmdline").read_bytes()
    for pid in [*qemu_pids(platform.data_dir), *gateway_pids(platform.data_dir)]:
        assert int(_status(pid)["Uid"].split()[0]) in JAIL_UIDS, pid
    # What the agent keeps is its own: the data dir, its keys and database.
    for name in ("", "node.key", "space.db", "node-token"):
        path = platform.data_dir / name
        assert (path.stat().st_uid, path.stat().st_mode & 0o077) == (space.pw_uid, 0), name


def _ppid(pid: int) -> int | None:
    with contextlib.suppress(OSError, KeyError, ValueError):
        return int(_status(pid)["PPid"])
    return None
