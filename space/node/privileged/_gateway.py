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
import shutil
import signal
import stat
import sys
from pathlib import Path

from space.node.api import Unavailable
from space.node.network.gateway_procs import UPSTREAM_CA_NAME, running_gateways
from space.node.privileged._jails import release_uid, share, take_uid

__all__ = ["start_gateway", "stop_gateways"]

log = logging.getLogger(__name__)

_LOG_NAME = "gateway.log"


async def start_gateway(
    directory: Path,
    state: list[str],
    options: list[str],
    upstream_ca: Path | None,
    environment: dict[str, str],
    owner: tuple[int, int],
) -> None:
    """Fork off a gateway (``python -P -m space.node.egress options``) in ``directory``;
    returns once it is forked, not once it answers. Its files are shared with the node
    agent's group (``owner``'s gid), its log is the agent's. Raises Unavailable."""
    uid = take_uid()
    try:
        try:
            await asyncio.to_thread(_hand_over, directory, state, upstream_ca, uid, owner[1])
            log_fd = os.open(
                directory / _LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
            )
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
                cwd=directory,
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
    directory: Path, state: list[str], upstream_ca: Path | None, uid: int, group: int
) -> None:
    """Give ``uid`` the directory and its ``state`` trees (a gateway before it may have
    had another uid), and a copy of the upstream CA bundle, wherever that is; their
    group is the node agent's (``group``), directories set-group-id so that what the
    gateway makes stays in it. Anything else in the directory (the sandboxes' CAs, the
    log) stays the agent's own."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in state:
        (directory / name).mkdir(mode=0o700, exist_ok=True)
    if upstream_ca is not None:
        copy = directory / UPSTREAM_CA_NAME
        shutil.copyfile(upstream_ca, copy)
        os.chmod(copy, 0o600)
        os.chown(copy, uid, group, follow_symlinks=False)
    share(directory, uid, group)
    for name in state:
        for root, dirs, files in os.walk(directory / name):
            for entry in (root, *(os.path.join(root, n) for n in dirs + files)):
                mode = os.lstat(entry).st_mode
                if stat.S_ISREG(mode) or stat.S_ISDIR(mode):  # never a link's target
                    share(Path(entry), uid, group)


def _unprivileged(uid: int) -> list[str]:
    """setpriv's argv running the rest as ``uid`` (gid alike), with no supplementary
    groups, no capabilities in any set, and ``no_new_privs`` (issue 18)."""
    ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    caps = ["--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all"]
    return ["setpriv", *ids, *caps, "--no-new-privs", "--"]
