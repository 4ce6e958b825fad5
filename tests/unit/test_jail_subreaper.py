"""The node's process is a child subreaper while it has a jail (its jailed VMMs and
runsc's processes, orphaned by their launcher, become its children and are reaped
there), and stops being one when its last jail closes: an orphan it took on after that
would be reaped by no one, and ``runsc delete`` waits for a gVisor sandbox's process to
be reaped (a test process that had run a node, then outlived a `space serve` whose
gVisor sandbox was re-adopted, hung a hibernate that way)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    from space.node.vmm.jail import jail_for

    def orphan_comes_to_us() -> bool:
        child = os.fork()
        if child == 0:
            if os.fork() == 0:
                time.sleep(0.2)
                os._exit(0)
            os._exit(0)
        os.waitpid(child, 0)
        time.sleep(0.6)  # the grandchild has exited: reaped by init, or our zombie
        try:
            return os.waitpid(-1, os.WNOHANG)[0] != 0
        except ChildProcessError:
            return False

    print(orphan_comes_to_us())
    first, second = jail_for(Path("/run/space-test-a")), jail_for(Path("/run/space-test-b"))
    print(orphan_comes_to_us())
    first.close()
    print(orphan_comes_to_us())
    second.close()
    print(orphan_comes_to_us())
    """
)


def test_the_process_adopts_orphans_only_while_it_has_a_jail() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    # Before any jail; with two; with one left; with none.
    assert out == ["False", "True", "True", "False"]
