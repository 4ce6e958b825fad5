"""The egress gateway's processes as /proc shows them, and the files it is given.

A gateway is known by its working directory (a node's ``data_dir/egress``) and its
command line; the node agent uses this to adopt or wait for one, the root broker
to stop one.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["UPSTREAM_CA_NAME", "exited", "is_gateway", "running_gateways"]

#: The copy of the upstream CA bundle in the gateway's directory.
UPSTREAM_CA_NAME = "upstream-ca.pem"


def is_gateway(pid: int, data_dir: Path) -> bool:
    """Whether ``pid`` is still the gateway of ``data_dir`` (not a reused pid, not a
    zombie). By its command line, which any uid may read (its working directory only
    its own uid and root): ``--home`` names its directory, which it checks is its
    working directory."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    home = str(data_dir).encode()
    named = any(argv[i] == b"--home" and argv[i + 1] == home for i in range(len(argv) - 1))
    if not named:  # a gateway from before --home: by its working directory (root's view)
        try:
            named = os.readlink(f"/proc/{pid}/cwd") == str(data_dir)
        except OSError:
            return False
    return named and b"space.node.egress" in argv and not exited(pid)


def exited(pid: int) -> bool:
    """Gone, or a zombie: its cmdline reads empty while it exits, so only this tells."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def running_gateways(data_dir: Path) -> list[int]:
    """The pids of the live gateways of ``data_dir`` (a node's ``data_dir/egress``)."""
    data_dir = data_dir.resolve()
    pids = (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    return [pid for pid in pids if is_gateway(pid, data_dir)]
