"""A second node agent (`space node --control-url`) registers and takes sandboxes.

Both nodes run on this host, each with its own data directory and btrfs pool; the
control plane reaches the second one only through its HTTP API, as it would on
another host.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from space import Sandbox

from .platform import remote_node, running_platform

pytestmark = pytest.mark.vm


def test_a_registered_remote_node_runs_sandboxes_placed_on_it(tmp_path: Path) -> None:
    with running_platform(tmp_path / "control") as platform:
        key = platform.create_key("tenant")
        with remote_node(platform, tmp_path / "remote") as remote:
            remote_id = remote.node_id
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
