"""Starting and stopping the egress gateway, as root, so that it runs as nothing of it.

The gateway runs as a uid of the jails' range of its own (``_jails.take_uid``), no
capabilities, no supplementary groups, ``no_new_privs`` (``setpriv``), detached
(``setsid --fork``: not the broker's child, it outlives the node like QEMU), in its
directory, which with the state directories it names is handed to its uid first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import stat
import sys
from pathlib import Path

from space.node.api import Unavailable
from space.node.network.gateway_procs import UPSTREAM_CA_NAME, running_gateways
from space.node.privileged._jails import release_uid, share, share_held, take_uid
from space.node.privileged.pinned import Pinned

__all__ = ["start_gateway", "stop_gateways"]

log = logging.getLogger(__name__)

_LOG_NAME = "gateway.log"
#: A CA bundle is kilobytes (Debian's whole store is about 200 KiB).
_MAX_CA_BYTES = 4 << 20


async def start_gateway(
    directory: Pinned,
    state: list[str],
    options: list[str],
    upstream_ca: int | None,
    environment: dict[str, str],
    owner: tuple[int, int],
) -> None:
    """Fork off a gateway (``python -P -m space.node.egress options``) in ``directory``;
    returns once it is forked, not once it answers. ``upstream_ca`` is the CA bundle's
    open file, copied into the directory. Its files are shared with the node agent's
    group (``owner``'s gid), its log is the agent's. Raises Unavailable."""
    uid = take_uid()
    try:
        try:
            await asyncio.to_thread(_hand_over, directory, state, upstream_ca, uid, owner[1])
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
            log_fd = os.open(_LOG_NAME, flags, 0o600, dir_fd=directory.fd)
            os.fchown(log_fd, *owner)
        except OSError as exc:
            raise Unavailable(f"cannot prepare the egress gateway's files: {exc}") from exc
        argv = ["setsid", "--fork", *_unprivileged(uid), sys.executable, "-P", "-m"]
        argv += ["space.node.egress", *options]
        try:
            launcher = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                env=environment,
                cwd=directory.path,
            )
            await launcher.wait()  # setsid returns once the gateway is forked off
        except OSError as exc:
            raise Unavailable(f"cannot start the egress gateway: {exc}") from exc
        finally:
            os.close(log_fd)
    finally:
        release_uid(uid)  # it runs as uid now, or never will


def stop_gateways(directory: Path) -> None:
    """Kill every gateway running in ``directory``."""
    for pid in running_gateways(directory):
        log.warning("killing the egress gateway pid %s", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _hand_over(
    directory: Pinned, state: list[str], upstream_ca: int | None, uid: int, group: int
) -> None:
    """Give ``uid`` the directory and its ``state`` trees (a gateway before it may have
    had another uid), and a copy of the upstream CA bundle; their group is the node
    agent's (``group``), directories set-group-id so that what the gateway makes stays
    in it. Anything else in the directory (the sandboxes' CAs, the log) stays the
    agent's own. All by descriptor, never through a link (see pinned.py)."""
    for name in state:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=directory.fd)
    if upstream_ca is not None:
        _copy_ca(upstream_ca, directory.fd, uid, group)
    share_held(directory.fd, uid, group)
    for name in state:
        share(name, uid, group, dir_fd=directory.fd)
        for _, dirs, files, fd in os.fwalk(name, dir_fd=directory.fd):
            for entry in dirs + files:
                mode = os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode
                if stat.S_ISREG(mode) or stat.S_ISDIR(mode):  # never a link's target
                    share(entry, uid, group, dir_fd=fd)


def _copy_ca(source: int, dir_fd: int, uid: int, group: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    bundle = os.read(source, _MAX_CA_BYTES + 1)
    if len(bundle) > _MAX_CA_BYTES:
        raise OSError(f"the upstream CA bundle is over {_MAX_CA_BYTES} bytes")
    fd = os.open(UPSTREAM_CA_NAME, flags, 0o600, dir_fd=dir_fd)
    try:
        os.write(fd, bundle)
        os.fchown(fd, uid, group)
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _unprivileged(uid: int) -> list[str]:
    """setpriv's argv running the rest as ``uid`` (gid alike), with no supplementary
    groups, no capabilities in any set, and ``no_new_privs`` (issue 18)."""
    ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    caps = ["--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all"]
    return ["setpriv", *ids, *caps, "--no-new-privs", "--"]
