"""``python -m space.node.egress``: the egress gateway process, run by the node agent.

The node passes one end of a socketpair as ``--control-fd`` and speaks JSON lines on
it, one request per line, each answered in order: ``{"id": 1, "op": "attach",
"sandbox": ..., "netns": ..., "policy": {...}, "ca": path}``, ``"policy"`` (sandbox,
policy), ``"secrets"`` (sandbox, grants), ``"detach"`` (sandbox) and ``"ping"``;
answers are ``{"id": 1, "ok": true}`` or ``{"id": 1, "error": "..."}`` (an error never
quotes a secret). The gateway exits when the node closes its end or dies.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from space.node.egress.audit import AuditLog
from space.node.egress.gateway import Gateway, GatewayError
from space.node.egress.intercept import Interceptor
from space.node.egress.resolver import Resolver
from space.node.network.resolvers import parse_resolvers

log = logging.getLogger("space.egress")

#: A control line longer than this ends the session: the node never sends one.
_MAX_LINE = 1 << 20
_PR_SET_PDEATHSIG = 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m space.node.egress")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--audit-dir", type=Path, required=True)
    parser.add_argument("--resolver", action="append", default=[])
    parser.add_argument("--confdir", type=Path, required=True)
    parser.add_argument("--upstream-ca", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s egress %(levelname)s %(message)s")
    _die_with_parent()
    asyncio.run(_serve(args))
    return 0


def _die_with_parent() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the node died before prctl took effect
        sys.exit(1)


async def _serve(args: argparse.Namespace) -> None:
    resolver = Resolver(parse_resolvers(args.resolver))
    interceptor = Interceptor(args.confdir, args.upstream_ca)
    gateway = Gateway(AuditLog(args.audit_dir), resolver, interceptor)
    sock = socket.socket(fileno=args.control_fd)
    reader, writer = await asyncio.open_connection(sock=sock, limit=_MAX_LINE)
    try:
        while line := await reader.readline():
            answer = await _handle(gateway, line)
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
    except (ValueError, ConnectionError) as exc:  # an over-long line, a dead node
        log.warning("control channel ended: %s", exc)
    finally:
        await gateway.close()


async def _handle(gateway: Gateway, line: bytes) -> dict[str, object]:
    try:
        request = json.loads(line)
        if not isinstance(request, dict):
            raise GatewayError("a request is a JSON object")
    except (ValueError, GatewayError) as exc:
        return {"id": None, "error": f"bad request: {exc}"}
    answer: dict[str, object] = {"id": request.get("id")}
    try:
        await _dispatch(gateway, request)
    except GatewayError as exc:
        answer["error"] = str(exc)
    except (KeyError, TypeError) as exc:
        answer["error"] = f"bad request: {exc!r}"
    else:
        answer["ok"] = True
    return answer


async def _dispatch(gateway: Gateway, request: dict[str, object]) -> None:
    op = request.get("op")
    if op == "ping":
        return
    sandbox = str(request["sandbox"])
    if op == "attach":
        ca = request.get("ca")
        await gateway.attach(
            sandbox,
            Path(str(request["netns"])),
            request.get("policy"),
            Path(str(ca)) if ca else None,
        )
    elif op == "secrets":
        gateway.set_secrets(sandbox, request.get("grants"))
    elif op == "policy":
        gateway.set_policy(sandbox, request.get("policy"))
    elif op == "detach":
        await gateway.detach(sandbox)
    else:
        raise GatewayError(f"unknown op {op!r}")


if __name__ == "__main__":
    sys.exit(main())
