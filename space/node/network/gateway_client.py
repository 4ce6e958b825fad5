"""The node's handle on its egress gateway process (``python -m space.node.egress``).

The gateway runs apart from the node agent: it parses every hostile byte a guest sends
out (TLS, HTTP, DNS), and a fault there must not take the node down. The node starts
it with one end of a socketpair and keeps what it told it, so a gateway that died is
started again and told everything anew on the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from pathlib import Path

from space.node.errors import InvalidArgument, Unavailable
from space.node.interface import SecretGrant
from space.node.wire import encode_grants

__all__ = ["GatewayProcess"]

log = logging.getLogger(__name__)

_REQUEST_TIMEOUT_S = 10.0
_START_TIMEOUT_S = 30.0


class GatewayProcess:
    """Start with ``await GatewayProcess.start(...)``; every method raises Unavailable
    if the gateway cannot be reached even after a restart, InvalidArgument if it
    refused the request (a bad policy)."""

    def __init__(self, data_dir: Path, resolvers: list[str], upstream_ca: Path | None) -> None:
        self._data_dir, self._resolvers, self._upstream_ca = data_dir, resolvers, upstream_ca
        self._audit_dir = data_dir / "audit"
        self._attached: dict[str, tuple[Path, object, Path]] = {}
        self._secrets: dict[str, list[dict[str, object]]] = {}
        self._proc: asyncio.subprocess.Process | None = None
        self._stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()
        self._next_id = 0

    @classmethod
    async def start(
        cls, data_dir: Path, resolvers: list[str], upstream_ca: Path | None
    ) -> GatewayProcess:
        """Start the gateway; its audit logs go to ``data_dir/audit``, mitmproxy's state
        to ``data_dir/mitm``, its own log to ``data_dir/gateway.log``. ``upstream_ca``
        is the CA bundle upstream servers are verified with (None: the host's)."""
        gateway = cls(data_dir, resolvers, upstream_ca)
        async with gateway._lock:
            await gateway._spawn()
        return gateway

    async def attach(self, sandbox_id: str, netns: Path, policy: object, ca: Path) -> None:
        """Serve the sandbox's namespace under ``policy``, its TLS terminated with the
        CA at ``ca``; idempotent."""
        await self._call(_attach(sandbox_id, netns, policy, ca))
        self._attached[sandbox_id] = (netns, policy, ca)

    async def set_secrets(self, sandbox_id: str, grants: list[SecretGrant]) -> None:
        """Replace the sandbox's secret grants (kept in this process's memory too, to
        tell a restarted gateway; never written anywhere)."""
        body = encode_grants(grants)["grants"]
        await self._call({"op": "secrets", "sandbox": sandbox_id, "grants": body})
        self._secrets[sandbox_id] = body

    async def detach(self, sandbox_id: str) -> None:
        """Stop serving the sandbox; idempotent."""
        self._attached.pop(sandbox_id, None)
        self._secrets.pop(sandbox_id, None)
        await self._call({"op": "detach", "sandbox": sandbox_id})

    async def close(self) -> None:
        """End the gateway process (every sandbox loses its egress until the next start)."""
        async with self._lock:
            await self._stop()

    async def _call(self, request: dict[str, object]) -> None:
        async with self._lock:
            for attempt in (1, 2):
                if self._stream is None or self._proc is None or self._proc.returncode is not None:
                    await self._restart()
                try:
                    answer = await self._exchange(request)
                except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
                    log.warning("egress gateway did not answer (%s); restarting it", exc)
                    await self._stop()
                    if attempt == 2:
                        raise Unavailable(f"the egress gateway failed: {exc}") from exc
                    continue
                if "error" in answer:
                    raise InvalidArgument(str(answer["error"]))
                return

    async def _exchange(self, request: dict[str, object]) -> dict[str, object]:
        assert self._stream is not None
        reader, writer = self._stream
        self._next_id += 1
        writer.write(json.dumps({**request, "id": self._next_id}).encode() + b"\n")
        async with asyncio.timeout(_REQUEST_TIMEOUT_S):
            await writer.drain()
            line = await reader.readline()
        answer = json.loads(line)
        if not isinstance(answer, dict) or answer.get("id") != self._next_id:
            raise ValueError(f"unexpected answer {line[:200]!r}")
        return answer

    async def _restart(self) -> None:
        await self._stop()
        await self._spawn()
        for sandbox_id, (netns, policy, ca) in list(self._attached.items()):
            answer = await self._exchange(_attach(sandbox_id, netns, policy, ca))
            if "error" in answer:
                log.warning(
                    "re-attaching %s to the gateway failed: %s", sandbox_id, answer["error"]
                )
                continue
            grants = self._secrets.get(sandbox_id)
            if grants:
                await self._exchange({"op": "secrets", "sandbox": sandbox_id, "grants": grants})

    async def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        argv = [sys.executable, "-m", "space.node.egress", "--control-fd", str(theirs.fileno())]
        argv += ["--audit-dir", str(self._audit_dir), "--confdir", str(self._data_dir / "mitm")]
        if self._upstream_ca is not None:
            argv += ["--upstream-ca", str(self._upstream_ca)]
        for resolver in self._resolvers:
            argv += ["--resolver", resolver]
        self._audit_dir.mkdir(parents=True, exist_ok=True)
        log_fd = os.open(
            self._data_dir / "gateway.log",
            os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
            0o600,
        )
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                pass_fds=(theirs.fileno(),),
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        except OSError as exc:
            ours.close()
            raise Unavailable(f"cannot start the egress gateway: {exc}") from exc
        finally:
            theirs.close()
            os.close(log_fd)
        self._stream = await asyncio.open_connection(sock=ours, limit=1 << 20)
        try:
            async with asyncio.timeout(_START_TIMEOUT_S):
                answer = await self._exchange({"op": "ping"})
        except (OSError, TimeoutError, ValueError) as exc:
            await self._stop()
            raise Unavailable(f"the egress gateway did not start: {exc}") from exc
        if not answer.get("ok"):
            await self._stop()
            raise Unavailable(f"the egress gateway did not start: {answer}")

    async def _stop(self) -> None:
        if self._stream is not None:
            _, writer = self._stream
            self._stream = None
            writer.close()
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await proc.wait()  # it exits once its control channel closes
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def _attach(sandbox_id: str, netns: Path, policy: object, ca: Path) -> dict[str, object]:
    return {
        "op": "attach",
        "sandbox": sandbox_id,
        "netns": str(netns),
        "policy": policy,
        "ca": str(ca),
    }
