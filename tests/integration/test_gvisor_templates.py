"""gVisor sandboxes of a built template (issue 21), on a real node: one small build in a
build VM (TCG), then runsc on the template's tree, unpacked by root from the build's
encrypted disk without trusting what the guest wrote in it.

Its node makes no ready state (no boot beyond the build VM): a gVisor sandbox runs
the template's start command at create and waits for its ready check instead.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from space.node.api import SandboxSpec, SandboxState
from space.node.core.config import NodeConfig
from space.node.privileged._gvisor import TREE_ROOT

from .conftest import NodeHarness, started_node
from .test_gvisor import _leftovers
from .test_lifecycle import _sh
from .test_templates import _PROCESSES, _build, _built, _context, _removing_templates
from .test_templates import _spec as _spec_of

pytestmark = pytest.mark.vm

#: Written by the build's guest: a link to the host's secrets, a set-user-id file, a
#: FIFO, a file of the sandbox's user; none of it may reach the host as it says.
_RUN = (
    "ln -s /etc/shadow /opt/app/shadow-link && chmod 4755 /opt/app/server.sh"
    " && mkfifo /opt/app/fifo && echo built > /opt/built && chown 1000:1000 /opt/built"
)


def _spec() -> str:
    ready = '\n[ready]\ncommand = "test -s /tmp/alive"\ntimeout_s = 60\n'
    return _spec_of([_RUN], name="gvtpl") + ready


@pytest.fixture
def node(node_config: NodeConfig) -> Iterator[NodeHarness]:
    # A build VM boots under TCG on a machine others share: slow when loaded.
    config = replace(
        node_config, ready_state=False, guest_without_kvm="gvisor", boot_timeout_s=240.0
    )
    with started_node(config) as harness, _removing_templates(harness):
        yield harness


def test_a_built_template_runs_in_gvisor_from_its_own_tree_made_once_and_removed_with_it(
    node: NodeHarness, tmp_path: Path
) -> None:
    h = node
    info = _built(h.run(_build(h.node, _context(tmp_path, _spec()))))
    tree = h.config.data_dir / "pool" / "gvisor" / info.digest
    assert not tree.exists()  # made on the template's first gVisor sandbox
    # The worker's pool outlives this node: earlier tests may have left the base's tree.
    trees_before = set(os.listdir(tree.parent)) if tree.parent.exists() else set()

    started = time.monotonic()
    first = h.run(h.node.create_sandbox(SandboxSpec("gt-1", template="gvtpl:v1", guest="gvisor")))
    first_s = time.monotonic() - started
    assert (first.state, first.guest) == (SandboxState.RUNNING, "gvisor")
    # Files, env, workdir and the start command, ready (its check passed at create).
    assert _sh(h, "gt-1", "cat /opt/app/data.txt /opt/built") == "template data\nbuilt"
    assert _sh(h, "gt-1", 'echo "$GREETING"; pwd') == "hello from the template\n/opt/app"
    assert _sh(h, "gt-1", "test -s /tmp/alive && echo alive") == "alive"
    assert "server.sh" in _sh(h, "gt-1", _PROCESSES)
    assert _sh(h, "gt-1", "stat -c '%U %a' /opt/built /opt/app/server.sh") == "user 644\nroot 755"
    assert _sh(h, "gt-1", "readlink /opt/app/shadow-link") == "/etc/shadow"
    assert "root:" in _sh(h, "gt-1", "cat /opt/app/shadow-link")  # the guest's own file

    # On the host: read-only, no set-user-id bit, no FIFO, the link never followed.
    assert (
        subprocess.run(
            ["btrfs", "property", "get", "-ts", str(tree), "ro"], capture_output=True, text=True
        ).stdout.strip()
        == "ro=true"
    )
    root = tree / TREE_ROOT
    server = (root / "opt" / "app" / "server.sh").lstat()
    assert stat.S_IMODE(server.st_mode) == 0o755
    assert not os.path.lexists(root / "opt" / "app" / "fifo")
    assert os.readlink(root / "opt" / "app" / "shadow-link") == "/etc/shadow"
    assert (root / "opt" / "built").stat().st_uid == 1000
    # Nothing but trees in their directory: the decrypted disk had no name and is gone.
    assert set(os.listdir(tree.parent)) == trees_before | {info.digest}
    assert all(re.fullmatch(r"[0-9a-f]{64}", name) for name in trees_before)

    started = time.monotonic()
    h.run(h.node.create_sandbox(SandboxSpec("gt-2", template="gvtpl:v1", guest="gvisor")))
    second_s = time.monotonic() - started
    assert _sh(h, "gt-2", "cat /opt/built") == "built"
    print(f"\ngVisor create of a built template: first {first_s:.2f} s, then {second_s:.2f} s")
    assert second_s < first_s

    h.run(h.node.delete_template("gvtpl:v1"))
    assert not tree.exists()
    assert _sh(h, "gt-1", "cat /opt/built") == "built"  # its sandboxes live on
    for sandbox_id in ("gt-1", "gt-2"):
        h.run(h.node.delete_sandbox(sandbox_id))
        assert _leftovers(h, sandbox_id) == []


def test_a_stale_tree_goes_when_the_node_starts(node: NodeHarness) -> None:
    """A tree of a digest no template has (an older base image's, or a template whose
    deletion was cut short) is removed at start; the base's own stays."""
    h = node
    h.run(h.node.create_sandbox(SandboxSpec("gt-base", guest="gvisor")))
    h.run(h.node.delete_sandbox("gt-base"))
    trees = h.config.data_dir / "pool" / "gvisor"
    base = h.run(h.node.list_templates())[0].digest
    stale = trees / ("0" * 64)
    subprocess.run(["btrfs", "subvolume", "snapshot", str(trees / base), str(stale)], check=True)
    h.restart()
    assert sorted(os.listdir(trees)) == [base]
