"""Run spaced: ``python3 -m space.guest [--stdio [--identity-record PATH | --gvisor]]
[--user-default NAME] [--home-default PATH]``.

Without ``--stdio`` it serves the virtio-serial port named ``space.agent`` (waiting for
the device to appear) and never exits on its own; with ``--stdio`` it speaks on
stdin/stdout and exits at EOF, killing the background processes it started. In
``--stdio`` mode system.identity changes nothing: it only records the changes (as JSON
lines appended to ``--identity-record``, if given), since that mode runs on a host;
with ``--gvisor`` (spaced is a gVisor sandbox's init) it changes the sandbox's hostname
and machine-id.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from space.protocol import PORT_NAME

from ._daemon import Daemon
from ._identity import system_for
from ._request import Accounts
from ._spawner import Spawners
from ._transport import Transport, find_port

__all__ = ["main"]

_log = logging.getLogger("spaced")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="spaced", description=__doc__)
    parser.add_argument("--stdio", action="store_true", help="frames on stdin/stdout")
    parser.add_argument("--port-name", default=PORT_NAME, help="virtio-serial port name")
    parser.add_argument("--user-default", help='account that stands in for "user"')
    parser.add_argument("--home-default", help='home directory of "user"')
    parser.add_argument(
        "--identity-record",
        metavar="PATH",
        help="--stdio only: append the identity changes to PATH instead of making them",
    )
    parser.add_argument(
        "--gvisor",
        action="store_true",
        help="--stdio only: spaced is a gVisor sandbox's init; system.identity applies",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.identity_record is not None and not args.stdio:
        parser.error("--identity-record needs --stdio")
    if args.gvisor and (not args.stdio or args.identity_record is not None):
        parser.error("--gvisor needs --stdio and no --identity-record")
    return args


def _open_port(name: str) -> int:
    """Wait for the port's device node (modules may still be loading) and open it."""
    while True:
        device = find_port(name)
        if device is not None:
            try:
                return os.open(device, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                _log.warning("cannot open %s: %s", device, exc)
        time.sleep(0.1)


def _use_child_watcher(init: bool) -> None:
    """Watch children without a thread each: Python 3.11's default (ThreadedChildWatcher)
    starts one for every process, ~6 ms per exec on the emulated guest CPU.

    ``init`` (spaced is a gVisor sandbox's PID 1): every orphan of the sandbox becomes
    spaced's child, and only a wait reaps it, so a watcher that waits for any child on
    SIGCHLD (FastChildWatcher; spaced starts processes through asyncio only, so it
    takes no other waiter's child). Else pidfds on the loop, where the kernel has them;
    3.12+ picks pidfds by itself.
    """
    if sys.version_info >= (3, 12):
        return
    loop = asyncio.get_running_loop()
    watcher: asyncio.AbstractChildWatcher
    if init:
        # An orphan is an unknown pid to the watcher, reaped as it should be: no warning.
        logging.getLogger("asyncio").addFilter(
            lambda record: not record.getMessage().startswith("Caught subprocess termination")
        )
        watcher = asyncio.FastChildWatcher()
    else:
        try:
            os.close(os.pidfd_open(os.getpid()))
        except (AttributeError, OSError):
            return  # a kernel before 5.3
        watcher = asyncio.PidfdChildWatcher()
    watcher.attach_loop(loop)
    asyncio.set_child_watcher(watcher)


async def _serve(args: argparse.Namespace) -> None:
    if args.stdio:
        read_fd = os.dup(sys.stdin.fileno())
        write_fd = os.dup(sys.stdout.fileno())
        # Nothing else may write frames' bytes: keep stray prints off the channel.
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        transport = Transport(read_fd, write_fd, reconnecting=False)
    else:
        fd = _open_port(args.port_name)
        transport = Transport(fd, fd, reconnecting=True)
    _use_child_watcher(init=args.gvisor and os.getpid() == 1)
    identity = system_for(args.stdio, args.identity_record, gvisor=args.gvisor)
    accounts = Accounts(args.user_default, args.home_default)
    # Under gVisor glibc's posix_spawn (a stack mapped per clone) costs more than
    # CPython's own vfork: 5.0 ms against 4.0 for ``true``; in a VM it costs less.
    spawners = Spawners(posix_spawn=not args.gvisor)
    daemon = Daemon(transport, accounts, identity=identity, spawners=spawners)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, daemon.stopped.set)
    await daemon.run()


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="spaced %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
