"""The node agent's end of the root broker: ``RootBroker``, one per node.

The agent starts its broker (as root, while it still is) with the scope it will
keep, and from then on asks it for everything that needs root. Requests go out as
lines on one end of a socket pair, several at once; each answer comes back by id.
A broker that died is started again on the next request with the same scope, while
the agent is root (a node that dropped root must be restarted); the requests it had
not answered fail with Unavailable. Any event loop may ask (a server starts its broker
before its loop runs; tests run several loops).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

from space.node.api import ERROR_BY_CODE, NodeError, Unavailable
from space.node.core.environment import python_environment
from space.node.network.fd_lines import FdLineReader, close_fds, write_line
from space.node.privileged.requests import Request, Scope, encode

__all__ = ["RootBroker", "broker_for", "start_broker"]

log = logging.getLogger(__name__)

#: What one answer may be: a value, an error message.
_MAX_ANSWER_BYTES = 64 * 1024
#: The slowest request is a quota rescan of a large pool (the command's own bound).
_REQUEST_TIMEOUT_S = 660.0
_BROKERS: dict[Path, RootBroker] = {}


class RootBroker:
    """The broker of the node whose run root is ``scope.run_root``."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[tuple[dict[str, object], list[int]]]] = {}
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._write_lock = asyncio.Lock()
        self._start_lock = asyncio.Lock()

    async def call(
        self, request: Request, *, fds: tuple[int, ...] = (), give: bool = False
    ) -> object:
        """Ask ``request``; its value. Raises the NodeError leaf the broker answered,
        or Unavailable if the broker cannot be reached. With ``give`` the descriptors
        ``fds`` are closed here as soon as they are sent (or the request fails): a
        pipe's end handed over, whose peer waits for its last copy to close."""
        value, received = await self.call_with_fds(request, fds=fds, give=give)
        close_fds(received)
        return value

    async def call_with_fds(
        self, request: Request, *, fds: tuple[int, ...] = (), give: bool = False
    ) -> tuple[object, list[int]]:
        """``call``, with the descriptors the answer carried (the caller's to close)."""
        try:
            sock = await self._running()
        except BaseException:
            if give:
                close_fds(list(fds))
            raise
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            try:
                async with self._write_lock:
                    await write_line(sock, encode(request_id, request), list(fds))
            finally:
                if give:
                    close_fds(list(fds))
            async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                answer, received = await future
        except (OSError, TimeoutError) as exc:
            raise Unavailable(f"the root broker did not answer {request.op}: {exc}") from exc
        finally:
            self._pending.pop(request_id, None)
        if answer.get("ok") is True:
            return answer.get("value"), received
        close_fds(received)
        error = answer.get("error")
        kind, message = "internal", "the root broker failed"
        if isinstance(error, dict):
            kind, message = str(error.get("kind")), str(error.get("message"))
        raise ERROR_BY_CODE.get(kind, NodeError)(f"{request.op}: {message}")

    async def _running(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the reader and locks belong to the loop they run in
            self._loop = loop
            self._write_lock, self._start_lock = asyncio.Lock(), asyncio.Lock()
            self._stop_reader()
            if self._sock is not None:
                self._reader_task = loop.create_task(self._read(self._sock))
        async with self._start_lock:
            if self._sock is None or self._proc is None or self._proc.poll() is not None:
                await self._spawn()
            elif self._reader_task is None or self._reader_task.done():
                # Its reader was cancelled with every task (asyncio.run's end, on
                # SIGTERM), and the cleanups that run then still call the broker:
                # without a reader each call waited the whole request timeout.
                self._reader_task = loop.create_task(self._read(self._sock))
            assert self._sock is not None
            return self._sock

    async def _spawn(self) -> None:
        self._disconnect()
        if os.geteuid() != 0:  # a node that dropped root cannot start it again
            raise Unavailable("the root broker is not running and only root can start it")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            argv = [sys.executable, "-P", "-m", "space.node.privileged"]
            argv += ["--fd", str(theirs.fileno()), "--scope", self.scope.to_json()]
            # Not an asyncio subprocess, whose transport is its loop's: the broker
            # serves whichever loop asks (tests run several).
            self._proc = subprocess.Popen(  # noqa: ASYNC220 - a fork and exec, no wait
                argv,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                env=python_environment(),
            )
        except OSError as exc:
            mine.close()
            raise Unavailable(f"cannot start the root broker: {exc}") from exc
        finally:
            theirs.close()
        mine.setblocking(False)
        self._sock = mine
        self._reader_task = asyncio.get_running_loop().create_task(self._read(mine))

    async def _read(self, sock: socket.socket) -> None:
        reader = FdLineReader(sock, max_line_bytes=_MAX_ANSWER_BYTES)
        try:
            while True:
                line, fds = await reader.readline()
                if not line:
                    break
                self._deliver(line, fds)
        except (OSError, ValueError) as exc:
            log.error("the root broker's connection failed: %s", exc)
        finally:
            reader.close()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionResetError("the root broker exited"))

    def _deliver(self, line: bytes, fds: list[int]) -> None:
        try:
            answer = json.loads(line)
            future = self._pending.get(answer["id"])
        except (ValueError, KeyError, TypeError):
            future = None
        if future is None or future.done():
            close_fds(fds)
            log.error("an unexpected answer from the root broker: %r", line[:200])
            return
        future.set_result((answer, fds))

    def _stop_reader(self) -> asyncio.Task[None] | None:
        """Cancel the reader task if its loop still runs; the task, if it is not done."""
        task, self._reader_task = self._reader_task, None
        if task is None or task.done() or task.get_loop().is_closed():
            return None
        task.cancel()
        return task

    def _disconnect(self) -> None:
        sock, self._sock = self._sock, None
        task = self._stop_reader()
        if task is not None and sock is not None:
            task.add_done_callback(lambda _: sock.close())  # once the reader let go of it
        elif sock is not None:
            sock.close()

    async def close(self) -> None:
        """End the broker (it exits when its socket closes); what it started runs on.
        Idempotent."""
        _BROKERS.pop(self.scope.run_root, None)
        await self._end()

    async def _end(self) -> None:
        self._disconnect()
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)


async def start_broker(scope: Scope) -> RootBroker:
    """The running broker of ``scope.run_root``'s node, started now if there is none.
    Raises Unavailable if it cannot start, InvalidArgument-free: an existing broker of
    the run root with another scope is replaced."""
    broker = _BROKERS.get(scope.run_root)
    if broker is not None and broker.scope != scope:
        await broker.close()
        broker = None
    if broker is None:
        broker = _BROKERS[scope.run_root] = RootBroker(scope)
    await broker._running()
    return broker


def broker_for(run_root: Path) -> RootBroker:
    """The broker ``start_broker`` started for the node of ``run_root``. Raises
    Unavailable if there is none (the node has not started, or has closed)."""
    broker = _BROKERS.get(run_root)
    if broker is None:
        raise Unavailable(f"no root broker runs for {run_root}")
    return broker
