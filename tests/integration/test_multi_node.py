"""A second node agent (`space node --control-url`) registers and takes sandboxes.

Both nodes run on this host, each with its own data directory and btrfs pool; the
control plane reaches the second one only through its HTTP API, as it would on
another host.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from space import Sandbox

from ..ports import free_port
from .platform import SPACE, Platform, release, running_platform

pytestmark = pytest.mark.vm


@contextlib.contextmanager
def remote_node(platform: Platform, data_dir: Path) -> Iterator[str]:
    """Run `space node` registered with ``platform``; yield its node id once registered."""
    data_dir.mkdir(parents=True)
    port = free_port()
    command = [
        *SPACE,
        "node",
        "--control-url",
        platform.url,
        "--token-file",
        str(platform.data_dir / "node-token"),
        "--listen",
        f"127.0.0.1:{port}",
        "--data-dir",
        str(data_dir),
    ]
    with (data_dir / "node.log").open("ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while b"registered with" not in (data_dir / "node.log").read_bytes():
            assert process.poll() is None, (data_dir / "node.log").read_text()
            assert time.monotonic() < deadline, "node did not register in time"
            time.sleep(0.2)
        yield (data_dir / "node_id").read_text().strip()
    finally:
        process.terminate()
        process.wait(timeout=30)
        leaked = release(data_dir)
        assert not leaked, f"left behind by the remote node: {leaked}"


def test_a_registered_remote_node_runs_sandboxes_placed_on_it(tmp_path: Path) -> None:
    with running_platform(tmp_path / "control") as platform:
        key = platform.create_key("tenant")
        with remote_node(platform, tmp_path / "remote") as remote_id:
            sandboxes = [Sandbox.create(api_url=platform.url, api_key=key) for _ in range(2)]
            try:
                placed = {
                    httpx.get(
                        f"{platform.url}/v1/sandboxes/{s.sandbox_id}",
                        headers={"Authorization": f"Bearer {key}"},
                        timeout=30,
                    ).json()["node_id"]
                    for s in sandboxes
                }
                assert remote_id in placed and len(placed) == 2
                for s in sandboxes:
                    assert s.commands.run("hostname").exit_code == 0
                    s.files.write("/tmp/where", s.sandbox_id)
                    assert s.files.read("/tmp/where") == s.sandbox_id
            finally:
                for s in sandboxes:
                    s.kill()
