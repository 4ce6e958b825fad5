"""Sockets bound inside another network namespace, made by the root broker.

A socket belongs to the namespace of the thread that created it and stays there. So a
short-lived thread enters the sandbox's namespace (setns, which Python 3.11's os module
lacks, hence ctypes), makes and binds the socket, and ends. The broker passes the
gateway's listeners so made to the node agent, which hands them over the gateway's
control socket (space.node.network.fd_lines), and the gateway serves them from the
host's namespace: it listens in every sandbox without any route between them and the
host, and without the privilege to enter a namespace (issue 18).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import threading
from pathlib import Path

__all__ = ["bind_in_netns"]

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def bind_in_netns(netns: Path, kind: int, address: tuple[str, int]) -> socket.socket:
    """A socket of ``kind`` (SOCK_STREAM listening, or SOCK_DGRAM) bound to ``address``
    in the namespace at ``netns``. Raises OSError."""
    result: list[socket.socket | BaseException] = []
    thread = threading.Thread(target=lambda: result.append(_bind(netns, kind, address)))
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _bind(netns: Path, kind: int, address: tuple[str, int]) -> socket.socket | BaseException:
    # The thread ends right after; it returns to the host's namespace anyway so that
    # nothing else that might run on it later sees the sandbox's namespace.
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
            try:
                return _make(kind, address)
            finally:
                _setns(home)
        finally:
            os.close(target)
    except BaseException as exc:
        return exc
    finally:
        os.close(home)


def _make(kind: int, address: tuple[str, int]) -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind)
    try:
        if kind == socket.SOCK_STREAM:
            # Not on UDP: there it lets any socket of the namespace that sets it too
            # (a gVisor guest's are the namespace's own) bind the same address and
            # take the gateway's DNS datagrams.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        if kind == socket.SOCK_STREAM:
            sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")
