"""The node's handle on its egress gateway process (``python -m space.node.egress``).

The gateway runs apart from the node agent: it parses every hostile byte a guest sends
out (TLS, HTTP, DNS), and a fault there must not take the node down. It also outlives
the agent, as QEMU does, so a node restart cuts no connection: a starting node connects
to the gateway's control socket and adopts it if it runs this very code with this
configuration (``fingerprint``), and replaces it otherwise. A gateway that died is
started again on the next request and told everything the node told the last one.

It runs unprivileged (issue 18), started and stopped by the node's root broker
(space.node.privileged: a uid of the VMM jails' range of its own, no capabilities, no
supplementary groups, ``no_new_privs``), its working directory ``data_dir``, which with
its audit logs and mitmproxy's state is handed to its uid. It enters no namespace: the
broker binds its listeners in each sandbox's, and the node sends them over the control
socket (space.node.network.fd_lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from space.node.api import (
    EGRESS_DECISIONS,
    InvalidArgument,
    NodeError,
    PolicyBounds,
    SecretGrant,
    Unavailable,
    encode_grants,
)
from space.node.core.environment import python_environment
from space.node.network.fd_lines import close_fds, send_line
from space.node.network.gateway_procs import (
    UPSTREAM_CA_NAME,
    exited,
    is_gateway,
    running_gateways,
)
from space.node.privileged import RootBroker
from space.node.privileged.requests import BindListeners, StartGateway, StopGateways
from space.node.vmm.qemu import console_tail

__all__ = ["GatewayProcess", "fingerprint", "running_gateways"]

log = logging.getLogger(__name__)

_REQUEST_TIMEOUT_S = 10.0
#: A stats request waits behind no more than this (it serves a Prometheus scrape).
_STATS_TIMEOUT_S = 1.0
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0
_POLL_S = 0.05
#: How long a gateway just started may take to show up in /proc.
_GRACE_S = 1.0
#: sun_path holds 108 bytes, the terminating NUL included.
_MAX_SOCKET_PATH = 107
#: Of the gateway's log, quoted when it did not start.
_LOG_TAIL_BYTES = 2048
#: The gateway's files, relative to its working directory (``data_dir``).
_SOCKET_NAME, _AUDIT, _MITM = "control.sock", "audit", "mitm"
#: The code the gateway runs: the space package (its egress modules import across it).
_SOURCES = Path(__file__).resolve().parents[2]


def fingerprint(
    resolvers: list[str], upstream_ca: Path | None, bounds: PolicyBounds | None = None
) -> str:
    """What a gateway must match to be adopted: its code, Python, and configuration."""
    digest = hashlib.sha256(sys.version.encode())
    for path in sorted(_SOURCES.rglob("*.py")):
        digest.update(str(path.relative_to(_SOURCES)).encode() + b"\0" + path.read_bytes())
    config: dict[str, object] = {"resolvers": resolvers, "upstream_ca": str(upstream_ca)}
    config["bounds"] = _bounds_argv(bounds or PolicyBounds())
    if upstream_ca is not None:
        with contextlib.suppress(OSError):
            config["upstream_ca_sha256"] = hashlib.sha256(upstream_ca.read_bytes()).hexdigest()
    digest.update(json.dumps(config, sort_keys=True).encode())
    return digest.hexdigest()[:32]


def _bounds_argv(bounds: PolicyBounds) -> list[str]:
    """The gateway's options for ``bounds`` (own addresses it reads itself)."""
    argv = [arg for network in bounds.operator_ranges for arg in ("--allow-range", str(network))]
    return argv + (["--allow-wide-any-port"] if bounds.allow_wide_any_port else [])


class GatewayProcess:
    """Start with ``await GatewayProcess.start(...)``; every method raises Unavailable
    if the gateway cannot be reached even after a restart, InvalidArgument if it
    refused the request (a bad policy)."""

    def __init__(
        self,
        data_dir: Path,
        resolvers: list[str],
        upstream_ca: Path | None,
        bounds: PolicyBounds | None = None,
        *,
        broker: RootBroker,
    ) -> None:
        # Resolved: it is matched against a gateway's /proc/PID/cwd.
        self._data_dir = data_dir.resolve()
        self._broker = broker
        self._resolvers, self._upstream_ca = resolvers, upstream_ca
        self._bounds = bounds or PolicyBounds()
        self._socket = data_dir / _SOCKET_NAME
        self._version = fingerprint(resolvers, upstream_ca, self._bounds)
        self._attached: dict[str, tuple[Path, object, Path]] = {}
        self._secrets: dict[str, list[dict[str, object]]] = {}
        self._pid: int | None = None
        self._adopted = False
        self._stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()
        self._next_id = 0

    @classmethod
    async def start(
        cls,
        data_dir: Path,
        resolvers: list[str],
        upstream_ca: Path | None,
        bounds: PolicyBounds | None = None,
        *,
        broker: RootBroker,
    ) -> GatewayProcess:
        """Adopt the gateway of ``data_dir`` if one of this version runs, else start
        one; its audit logs go to ``data_dir/audit``, mitmproxy's state to
        ``data_dir/mitm``, its own log to ``data_dir/gateway.log``; ``data_dir`` must
        not hold anything the gateway may not read (its uid owns it). ``upstream_ca`` is
        the CA bundle upstream servers are verified with (None: the host's); ``bounds``
        what policies may name (None: the strictest); ``broker`` the node's root broker,
        which starts and stops it."""
        gateway = cls(data_dir, resolvers, upstream_ca, bounds, broker=broker)
        if len(str(gateway._socket)) > _MAX_SOCKET_PATH:
            raise Unavailable(f"the gateway's control socket path is too long: {gateway._socket}")
        async with gateway._lock:
            if not await gateway._adopt():
                await gateway._spawn()
        return gateway

    @property
    def pid(self) -> int | None:
        """The gateway's process id, once started or adopted."""
        return self._pid

    async def attach(self, sandbox_id: str, netns: Path, policy: object, ca: Path) -> None:
        """Serve the sandbox's namespace under ``policy``, its TLS terminated with the
        CA at ``ca``; idempotent. Raises Unavailable also if the CA cannot be read or
        the listeners cannot be bound in ``netns`` (gone, ports taken)."""
        request = _attach(sandbox_id, netns, policy, ca)
        known = sandbox_id in self._attached
        await self._ask(lambda: self._attach_exchange(netns, request))
        self._attached[sandbox_id] = (netns, policy, ca)
        grants = self._secrets.get(sandbox_id)
        if grants and not known:  # given while it was not attached (set_secrets)
            await self._call({"op": "secrets", "sandbox": sandbox_id, "grants": grants})

    def serves(self, sandbox_id: str) -> bool:
        """Whether this node attached the sandbox (and did not detach it since)."""
        return sandbox_id in self._attached

    async def set_secrets(self, sandbox_id: str, grants: list[SecretGrant]) -> None:
        """Replace the sandbox's secret grants (kept in this process's memory too, to
        tell a restarted gateway, or the gateway once the sandbox is attached; never
        written anywhere)."""
        body = encode_grants(grants)["grants"]
        if sandbox_id in self._attached:
            await self._call({"op": "secrets", "sandbox": sandbox_id, "grants": body})
        self._secrets[sandbox_id] = body

    async def detach(self, sandbox_id: str) -> None:
        """Stop serving the sandbox; idempotent."""
        self._attached.pop(sandbox_id, None)
        self._secrets.pop(sandbox_id, None)
        await self._call({"op": "detach", "sandbox": sandbox_id})

    async def retain(self) -> None:
        """Detach every sandbox this node did not attach (an adopted gateway may serve
        some a node deleted while another agent ran)."""
        await self._call({"op": "retain", "sandboxes": sorted(self._attached)})

    async def decisions(self) -> dict[str, int]:
        """The gateway's ``allow`` and ``deny`` counts since it began (they restart from
        0 with a new gateway, as Prometheus counters may). Never starts or restarts a
        gateway for it: {} when none answers within _STATS_TIMEOUT_S or it answers
        something else (a gateway of older code)."""
        if self._stream is None:
            return {}
        try:
            async with asyncio.timeout(_STATS_TIMEOUT_S), self._lock:
                answer = await self._exchange({"op": "stats"})
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
            log.info("egress gateway gave no decision counts: %s", exc)
            return {}
        counts = answer.get("decisions")
        if not isinstance(counts, dict):
            return {}
        return {
            str(name): count
            for name, count in counts.items()
            if name in EGRESS_DECISIONS and type(count) is int and count >= 0
        }

    async def close(self) -> None:
        """Leave the gateway serving the attached sandboxes for the next node to adopt;
        with none attached, end it."""
        async with self._lock:
            if self._attached:
                self._disconnect()
            else:
                await self._stop()

    async def abandon(self) -> None:
        """For a node whose start failed: leave an adopted gateway serving the
        sandboxes it knows, end one this node started."""
        async with self._lock:
            if self._adopted:
                self._disconnect()
            else:
                await self._stop()

    async def _call(self, request: dict[str, object]) -> None:
        await self._ask(lambda: self._exchange(request))

    async def _ask(self, exchange: Callable[[], Awaitable[dict[str, object]]]) -> None:
        """Run ``exchange``, restarting the gateway once if it does not answer."""
        async with self._lock:
            for attempt in (1, 2):
                if self._stream is None:
                    await self._restart()
                try:
                    answer = await exchange()
                except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
                    log.warning("egress gateway did not answer (%s); restarting it", exc)
                    await self._stop()
                    if attempt == 2:
                        raise Unavailable(f"the egress gateway failed: {exc}") from exc
                    continue
                if "error" in answer:
                    raise InvalidArgument(str(answer["error"]))
                return

    async def _attach_exchange(self, netns: Path, request: dict[str, object]) -> dict[str, object]:
        """Attach; with listeners bound in ``netns`` if the gateway has none there."""
        answer = await self._exchange(request)
        if answer.get("attached") is not False:
            return answer
        _, listeners = await self._broker.call_with_fds(BindListeners(name=netns.name))
        try:
            return await self._exchange(request, listeners)
        finally:
            close_fds(listeners)

    async def _exchange(
        self, request: dict[str, object], fds: list[int] | None = None
    ) -> dict[str, object]:
        """One request and its answer; ``fds`` go with the request (the gateway gets
        copies). Raises OSError, TimeoutError, ValueError, IncompleteReadError."""
        if self._stream is None:
            raise OSError("not connected to the gateway")
        reader, writer = self._stream
        self._next_id += 1
        line = json.dumps({**request, "id": self._next_id}).encode() + b"\n"
        if fds:
            # Nothing is buffered in the writer: each request waits for its answer.
            with socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno())) as dup:
                line = line[send_line(dup, line, fds) :]
        writer.write(line)
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
            try:
                answer = await self._attach_exchange(netns, _attach(sandbox_id, netns, policy, ca))
            except Unavailable as exc:
                answer = {"error": exc.message}
            if "error" in answer:
                log.warning(
                    "re-attaching %s to the gateway failed: %s", sandbox_id, answer["error"]
                )
                continue
            grants = self._secrets.get(sandbox_id)
            if grants:
                await self._exchange({"op": "secrets", "sandbox": sandbox_id, "grants": grants})

    async def _connect(self) -> dict[str, object] | None:
        """Connect to the control socket and ping; the answer, or None if no gateway
        answers there."""
        try:
            self._stream = await asyncio.open_unix_connection(str(self._socket), limit=1 << 20)
            answer = await self._exchange({"op": "ping"})
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
            self._disconnect()
            return None
        pid = answer.get("pid")
        self._pid = pid if isinstance(pid, int) else None
        return answer

    async def _adopt(self) -> bool:
        """Take over a running gateway of this version; end one of another version."""
        answer = await self._connect()
        if answer is None:
            return False
        if answer.get("version") == self._version:
            log.info("adopted the running egress gateway (pid %s)", self._pid)
            self._adopted = True
            return True
        log.info("replacing the egress gateway (pid %s): another version runs", self._pid)
        await self._stop()
        return False

    async def _spawn(self) -> None:
        """Have the broker start a gateway (detached: not the node's child, it outlives
        it like QEMU), and wait for its first answer. Raises Unavailable."""
        await self._kill("it does not answer")  # hung, if any
        log_path = self._data_dir / "gateway.log"
        await self._broker.call(
            StartGateway(
                directory=str(self._data_dir),
                state=[_AUDIT, _MITM],
                options=self._options(),
                upstream_ca=str(self._upstream_ca) if self._upstream_ca is not None else None,
                environment=python_environment(),
            )
        )
        try:
            async with asyncio.timeout(_START_TIMEOUT_S):
                answer = await self._await_start()
        except (OSError, TimeoutError) as exc:
            await self._kill("it did not start")
            self._disconnect()
            tail = " | ".join(console_tail(log_path, _LOG_TAIL_BYTES).strip().splitlines()[-5:])
            problem = f"{exc or 'timed out'}; gateway log: {tail or '(empty)'}"
            raise Unavailable(f"the egress gateway did not start: {problem}") from exc
        if answer.get("version") != self._version:
            await self._stop()
            raise Unavailable(f"the egress gateway did not start: it answered {answer}")

    async def _await_start(self) -> dict[str, object]:
        """The first ping answer of a gateway just forked off; OSError if it died."""
        for attempt in itertools.count():
            answer = await self._connect()
            if answer is not None:
                return answer
            if attempt * _POLL_S > _GRACE_S and not running_gateways(self._data_dir):
                raise OSError("it exited")
            await asyncio.sleep(_POLL_S)
        raise AssertionError("unreachable")

    def _options(self) -> list[str]:
        """The gateway's options (its paths relative to its working directory)."""
        argv = ["--home", str(self._data_dir), "--control-socket", _SOCKET_NAME]
        argv += ["--version", self._version]
        argv += ["--audit-dir", _AUDIT, "--confdir", _MITM]
        if self._upstream_ca is not None:
            argv += ["--upstream-ca", UPSTREAM_CA_NAME]
        for resolver in self._resolvers:
            argv += ["--resolver", resolver]
        return argv + _bounds_argv(self._bounds)

    async def _kill(self, why: str) -> None:
        """Have the broker kill every gateway of the directory (it can see them all)."""
        log.info("ending any egress gateway left in %s: %s", self._data_dir, why)
        await self._broker.call(StopGateways(directory=str(self._data_dir)))

    def _disconnect(self) -> None:
        if self._stream is not None:
            _, writer = self._stream
            self._stream = None
            writer.close()

    async def _stop(self) -> None:
        """End the gateway: ask it, then kill it if it has not gone in time."""
        pid, self._pid = self._pid, None
        self._adopted = False
        # Checked before asking: an exiting process's cmdline reads empty.
        ours = pid is not None and is_gateway(pid, self._data_dir)
        if self._stream is not None:
            with contextlib.suppress(
                OSError, TimeoutError, ValueError, asyncio.IncompleteReadError
            ):
                await self._exchange({"op": "shutdown"})
            self._disconnect()
        if pid is None or not ours or await _exit_of(pid):
            return
        try:
            await self._kill("it did not stop when asked")
        except NodeError as exc:
            log.error("cannot kill the egress gateway pid %s: %s", pid, exc)
            return
        if not await _exit_of(pid):
            log.error("the egress gateway pid %s did not exit", pid)


async def _exit_of(pid: int) -> bool:
    """Wait up to _STOP_TIMEOUT_S for ``pid`` to exit; whether it did."""
    for _ in range(int(_STOP_TIMEOUT_S / _POLL_S)):
        if exited(pid):
            return True
        await asyncio.sleep(_POLL_S)
    return exited(pid)


def _attach(sandbox_id: str, netns: Path, policy: object, ca: Path) -> dict[str, object]:
    """The attach request, carrying the CA's PEM: its file stays root's. Raises
    Unavailable if it cannot be read."""
    try:
        pem = ca.read_text()
    except (OSError, ValueError) as exc:
        raise Unavailable(f"cannot read the CA of {sandbox_id}: {exc}") from exc
    return {"op": "attach", "sandbox": sandbox_id, "netns": str(netns), "policy": policy, "ca": pem}
