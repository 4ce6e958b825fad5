"""The node agent's own user: what a server started as root does before it drops root.

The node agent (HTTP API, guest channels, pools, templates, lifecycle; the embedded
control plane with it) runs as an unprivileged user, ``space`` by default (issue 18).
What needs root is done by the root broker (space.node.privileged), which the server
starts while it is still root, with the scope the agent keeps. In order:

1. the user's uid and gid (never root's), and a check that every directory above the
   data dir lets that user through (a data dir under /root would not);
2. the data dir and the VMs' run root made the user's, also those an older, root
   node left (the pool's contents follow when the agent opens it: the broker's
   ``AdoptPool``); the egress gateway's directory keeps its own uid, in the user's
   group;
3. the guest image built into its cache if it is not there (debootstrap needs root);
4. the root broker started;
5. root dropped: the capability bounding set, supplementary groups, gid, uid (every
   capability goes with uid 0), ``no_new_privs``.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import stat
import sys
from collections.abc import Callable
from pathlib import Path

from space.node.agent.node import broker_scope
from space.node.api import InvalidArgument, Unavailable
from space.node.core.config import NodeConfig
from space.node.core.ownership import adopt_tree
from space.node.core.template import BASE
from space.node.images import build_template
from space.node.privileged import start_broker
from space.node.vmm.jail import JAIL_UIDS

__all__ = [
    "DEFAULT_USER",
    "become_node_user",
    "check_readable",
    "node_user",
    "prepare_directories",
]

#: The user a node agent started as root runs as, unless told otherwise.
DEFAULT_USER = "space"
_PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP = 38, 24
#: Where this very ``space`` package was imported from.
_PACKAGE_ROOT = Path(__file__).resolve().parents[3]
#: What stays root's in the data dir: nothing; what stays the gateway's: its state.
_GATEWAY_STATE = ("egress/audit", "egress/mitm")


def node_user(name: str) -> tuple[int, int]:
    """The uid and gid of the user ``name``. Raises InvalidArgument for an unknown
    user or root."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise InvalidArgument(
            f"no user {name!r} on this host (setup makes {DEFAULT_USER!r}; useradd --system)"
        ) from None
    if entry.pw_uid == 0:
        raise InvalidArgument(f"the node agent's user {name!r} is root")
    return entry.pw_uid, entry.pw_gid


async def become_node_user(
    config: NodeConfig, user: tuple[int, int], say: Callable[[str], None]
) -> None:
    """Prepare the node for ``user`` (uid, gid), start its root broker and drop root
    (see the module docstring). Call as root, before anything else of the node; the
    process runs as ``user`` on return. Raises InvalidArgument (a data dir the user
    cannot reach), Unavailable (the image build, the broker)."""
    prepare_directories(config, user)
    try:
        build_template(BASE, cache_dir=config.image_cache_dir, progress=say)
    except Exception as exc:
        raise Unavailable(f"building the base image failed: {exc}") from exc
    await start_broker(broker_scope(config, owner=user))
    _drop_root(*user)


def prepare_directories(config: NodeConfig, user: tuple[int, int]) -> None:
    """Steps 1 and 2 (the module docstring): check that ``user`` reaches the data dir,
    then make it and the run root the user's. Raises InvalidArgument."""
    uid, gid = user
    data_dir = config.data_dir.resolve()
    # Its data, and the code it goes on running (imported lazily) and starting.
    for needed in (data_dir.parent, _PACKAGE_ROOT, Path(sys.executable).parent):
        _check_reachable(needed, uid, gid)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    adopt_tree(data_dir, user, JAIL_UIDS, skip=[data_dir / n for n in _GATEWAY_STATE])
    run_root = config.effective_run_dir
    run_root.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(run_root.parent, 0o711)  # every node's run root is its agent's alone
    run_root.mkdir(mode=0o700, exist_ok=True)
    adopt_tree(run_root, user, JAIL_UIDS)  # live VMs' run dirs and sockets too


def check_readable(path: Path, user: tuple[int, int]) -> None:
    """That ``user`` can read the file ``path`` the agent opens after it drops root
    (a TLS key: give it to the user, or its group). Raises InvalidArgument."""
    uid, gid = user
    path = path.resolve()
    _check_reachable(path.parent, uid, gid)
    info = os.stat(path)
    bit = (
        stat.S_IRUSR if info.st_uid == uid else stat.S_IRGRP if info.st_gid == gid else stat.S_IROTH
    )
    if not info.st_mode & bit:
        raise InvalidArgument(
            f"the node agent's user (uid {uid}) cannot read {path} "
            f"({stat.filemode(info.st_mode)}, uid {info.st_uid}, gid {info.st_gid})"
        )


def _check_reachable(directory: Path, uid: int, gid: int) -> None:
    """Every directory from / to ``directory`` lets ``uid`` (primary group ``gid``)
    search it."""
    for path in (directory, *directory.parents):
        info = os.stat(path)
        if info.st_uid == uid:
            bit = stat.S_IXUSR
        elif info.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not info.st_mode & bit:
            raise InvalidArgument(
                f"the node agent's user (uid {uid}) cannot reach {directory}: {path} is "
                f"{stat.filemode(info.st_mode)}, not searchable by it"
            )


def _drop_root(uid: int, gid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last_cap + 1):  # nothing to regain by exec either
        _prctl(libc, _PR_CAPBSET_DROP, cap)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # clears every capability set: no uid is 0 any more
    _prctl(libc, _PR_SET_NO_NEW_PRIVS, 1)


def _prctl(libc: ctypes.CDLL, option: int, value: int) -> None:
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise Unavailable(f"prctl {option} failed: {os.strerror(ctypes.get_errno())}")
