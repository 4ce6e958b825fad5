"""``python -m space.node.egress``: the egress gateway process, run by the node agent.

It outlives the agent, as QEMU does: a node restart (an upgrade, a crash) leaves every
sandbox's egress, its open connections and its synthetic addresses as they were, and
the next agent adopts the gateway. The node speaks JSON lines on the unix socket
``--control-socket`` (mode 0600), one request per line, each answered in order:
``{"id": 1, "op": "attach", "sandbox": ..., "netns": ..., "policy": {...}, "ca":
path}``, ``"policy"`` (sandbox, policy), ``"secrets"`` (sandbox, grants), ``"detach"``
(sandbox), ``"retain"`` (sandboxes: detach all others), ``"ping"`` (answers the
``--version`` it was started with and its pid), ``"stats"`` (answers ``decisions``:
how many ``allow`` and ``deny`` decisions it audited since it began) and
``"shutdown"``. Answers are ``{"id": 1, "ok": true, ...}`` or ``{"id": 1, "error":
"..."}`` (an error never quotes a secret). It exits on ``shutdown`` or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path

from space.node.api import PolicyBounds
from space.node.egress.audit import AuditLog
from space.node.egress.gateway import Gateway, GatewayError, Listeners
from space.node.egress.intercept import Interceptor
from space.node.egress.resolver import Resolver
from space.node.network.fd_lines import FdLineReader, close_fds
from space.node.network.resolvers import parse_resolvers

log = logging.getLogger("space.egress")

#: A control line longer than this ends the session: the node never sends one.
_MAX_LINE = 1 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m space.node.egress")
    parser.add_argument("--home", type=Path, required=True, help="its working directory")
    parser.add_argument("--control-socket", type=Path, required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--audit-dir", type=Path, required=True)
    parser.add_argument("--resolver", action="append", default=[])
    parser.add_argument("--confdir", type=Path, required=True)
    parser.add_argument("--upstream-ca", type=Path)
    # What policies may name (space.node.api.egress_policy.PolicyBounds).
    parser.add_argument("--allow-range", action="append", default=[])
    parser.add_argument("--allow-wide-any-port", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s egress %(levelname)s %(message)s")
    if Path.cwd() != args.home:  # it names the gateway in /proc/PID/cmdline: keep it true
        parser.error(f"--home {args.home} is not the working directory {Path.cwd()}")
    # What it writes (audit logs, its socket) its own uid and the node agent's group
    # (that of its directory, set-group-id) may use, nobody else (issue 18).
    os.umask(0o007)
    args.control_socket.unlink(missing_ok=True)  # the node saw no gateway answer there
    try:
        asyncio.run(_serve(args))
    finally:
        args.control_socket.unlink(missing_ok=True)
    return 0


async def _serve(args: argparse.Namespace) -> None:
    resolver = Resolver(parse_resolvers(args.resolver))
    interceptor = Interceptor(args.confdir, args.upstream_ca)
    bounds = PolicyBounds.of(args.allow_range, allow_wide_any_port=args.allow_wide_any_port)
    gateway = Gateway(AuditLog(args.audit_dir), resolver, interceptor, bounds)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    identity = {"version": args.version, "pid": os.getpid()}

    async def session(conn: socket.socket) -> None:
        reader = FdLineReader(conn, max_line_bytes=_MAX_LINE)
        try:
            while True:
                line, fds = await reader.readline()
                if not line:
                    return
                answer = await _handle(gateway, line, fds, identity, stop)
                await loop.sock_sendall(conn, json.dumps(answer).encode() + b"\n")
        except (ValueError, OSError) as exc:  # an over-long line, a dead node
            log.warning("control session ended: %s", exc)
        finally:
            reader.close()
            conn.close()

    server = _listen(args.control_socket)
    log.info("serving control socket %s (version %s)", args.control_socket, args.version)
    accepting = asyncio.create_task(_accept(server, session))
    try:
        await stop.wait()
    finally:
        accepting.cancel()
        server.close()
        await gateway.close()
        log.info("stopped")


def _listen(path: Path) -> socket.socket:
    """The control socket at ``path``, 0660: only the gateway's uid and the node
    agent's group (its directory's) may connect (issue 18); umask 117 closes the
    window between bind and chmod."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old_umask = os.umask(0o117)
    try:
        server.bind(str(path))
        os.chmod(path, 0o660)
    finally:
        os.umask(old_umask)
    server.listen(8)
    server.setblocking(False)
    return server


async def _accept(
    server: socket.socket, session: Callable[[socket.socket], Coroutine[None, None, None]]
) -> None:
    """Serve every connection to ``server``, each in a task of its own."""
    loop = asyncio.get_running_loop()
    sessions: set[asyncio.Task[None]] = set()
    while True:
        conn, _ = await loop.sock_accept(server)
        conn.setblocking(False)
        task = asyncio.create_task(session(conn))
        sessions.add(task)
        task.add_done_callback(sessions.discard)


async def _handle(
    gateway: Gateway,
    line: bytes,
    fds: list[int],
    identity: dict[str, object],
    stop: asyncio.Event,
) -> dict[str, object]:
    """The answer to one request; ``fds`` are its descriptors, always consumed: those
    of an attach become its listeners, any others are closed."""
    try:
        request = json.loads(line)
        if not isinstance(request, dict):
            raise GatewayError("a request is a JSON object")
    except (ValueError, GatewayError) as exc:
        close_fds(fds)
        return {"id": None, "error": f"bad request: {exc}"}
    answer: dict[str, object] = {"id": request.get("id")}
    op = request.get("op")
    if op != "attach":
        close_fds(fds)
    try:
        if op == "attach":
            answer["attached"] = await _attach(gateway, request, fds)
        elif op == "ping":
            answer.update(identity)
        elif op == "stats":
            answer["decisions"] = gateway.decisions()
        elif op == "shutdown":
            stop.set()
        elif op == "retain":
            await gateway.retain({str(s) for s in _list(request["sandboxes"])})
        else:
            await _dispatch(gateway, str(op), request)
    except GatewayError as exc:
        answer["error"] = str(exc)
    except (KeyError, TypeError) as exc:
        answer["error"] = f"bad request: {exc!r}"
    else:
        answer["ok"] = True
    return answer


def _list(value: object) -> list[object]:
    if not isinstance(value, list):
        raise TypeError("expected a list")
    return value


async def _attach(gateway: Gateway, request: dict[str, object], fds: list[int]) -> bool:
    """Attach as ``request`` says, with the listeners ``fds`` (if any), which it owns."""
    listeners = Listeners.adopt(fds) if fds else None
    try:
        sandbox, netns = str(request["sandbox"]), str(request["netns"])
        ca = request.get("ca")
    except KeyError:
        if listeners is not None:
            listeners.close()
        raise
    pem = ca.encode() if isinstance(ca, str) and ca else None
    return await gateway.attach(sandbox, netns, request.get("policy"), pem, listeners)


async def _dispatch(gateway: Gateway, op: str, request: dict[str, object]) -> None:
    sandbox = str(request["sandbox"])
    if op == "secrets":
        gateway.set_secrets(sandbox, request.get("grants"))
    elif op == "policy":
        gateway.set_policy(sandbox, request.get("policy"))
    elif op == "detach":
        await gateway.detach(sandbox)
    else:
        raise GatewayError(f"unknown op {op!r}")


if __name__ == "__main__":
    sys.exit(main())
