"""The host's share of latency per layer (issue 21): REST + database, node, guest.

A child process runs what ``space serve`` runs (the root broker, the node agent as
``--user``, the control plane on loopback in the same event loop) and also answers
commands on its stdin: time ``Node.exec`` / ``Node.create_sandbox`` itself, in
process, without HTTP or database. The parent drives the REST API over one keep-alive
HTTP client and interleaves each REST call with the same call made on the node
directly, on the same sandbox, so both see the same load. Per layer, medians:

- guest: the guest's own spawn of ``true`` (``subprocess.run`` timed inside it);
- node: ``Node.exec`` of ``true`` (channel, spaced, spawn) less the guest's spawn;
- REST + DB: ``POST /v1/sandboxes/{id}/exec`` less ``Node.exec`` (the HTTP round trip,
  the key check, the sandbox lookup, the activity write, NDJSON); beside it the HTTP
  floor, a request the API refuses before any auth or database (404 outside /v1);
- the same for a create (``POST /v1/sandboxes`` against ``Node.create_sandbox``, each
  deleted after), and for an E2B ``Start`` against the same ``Node.exec``;

with a few (``--loads``, default 2) and a dozen (12) idle sandboxes beside the one
measured. Usage, as root: ``PYTHONPATH=. .venv/bin/python bench/bench_hostlat.py
[--runs 60] [--creates 8] [--guest gvisor] [--loads 2,12] [--database-url URL]``.
Everything is removed at the end, also on failure. Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._host import process_cpu_ms
from bench._platform import Api, say
from bench._stats import percentile
from bench.bench_e2b import Paths
from space.control.keys import create_key
from space.control.quota_admin import set_quotas
from space.control.settings import ControlSettings
from space.limits import QUOTAS
from space.node.agent import Node
from space.node.agent.node_user import become_node_user, node_user
from space.node.api import ExecExited, ExecOutput, ExecRequest, SandboxSpec
from space.node.core.config import NodeConfig
from tests.integration.conftest import release_data_dir

#: Timed inside the guest: the median of 30 spawns of ``true``, in ms, on stdout.
_GUEST_SPAWN = (
    "import subprocess,statistics,time\n"
    "t=[]\n"
    "for _ in range(30):\n"
    " s=time.perf_counter();subprocess.run(['true']);t.append(time.perf_counter()-s)\n"
    "print(statistics.median(t)*1000)\n"
)


# --- the child: the platform, and the node's own timings on request ----------------


async def _node_exec(node: Node, sandbox_id: str, argv: list[str]) -> bytes:
    out = b""
    async for event in await node.exec(sandbox_id, ExecRequest(argv=argv)):
        if isinstance(event, ExecOutput):
            out += event.data
        elif isinstance(event, ExecExited) and event.exit_code != 0:
            raise RuntimeError(f"{argv[0]} exited with {event.exit_code}")
    return out


async def _answer(node: Node, guest: str, command: dict[str, Any]) -> dict[str, Any]:
    op = command["op"]
    if op == "exec":
        start = time.perf_counter()
        await _node_exec(node, command["id"], ["true"])
        return {"ms": (time.perf_counter() - start) * 1000}
    if op == "guest_spawn":
        out = await _node_exec(node, command["id"], ["python3", "-c", _GUEST_SPAWN])
        return {"ms": float(out.decode().strip())}
    if op == "create":
        start = time.perf_counter()
        await node.create_sandbox(SandboxSpec(command["id"], guest=guest))
        return {"ms": (time.perf_counter() - start) * 1000}
    if op == "delete":
        await node.delete_sandbox(command["id"])
        return {"ms": 0.0}
    raise ValueError(f"unknown op {op!r}")


#: What starts the child's answers on its stdout (anything else there is passed on).
_ANSWER = "@answer "


def _say_to_parent(answer: dict[str, Any]) -> None:
    sys.stdout.write(_ANSWER + json.dumps(answer) + "\n")
    sys.stdout.flush()


def _read_answer(stdout: IO[str]) -> dict[str, Any]:
    while line := stdout.readline():
        if line.startswith(_ANSWER):
            answer: dict[str, Any] = json.loads(line[len(_ANSWER) :])
            return answer
        sys.stderr.write(line)
    return {"error": "the child exited"}


async def _serve_commands(node: Node, guest: str) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        try:
            answer = await _answer(node, guest, json.loads(line))
        except Exception as exc:  # reported to the parent, which stops
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        _say_to_parent(answer)


async def child(args: argparse.Namespace) -> None:
    from space.control.server import run_control_plane

    config = NodeConfig(
        data_dir=args.data_dir,
        pool_size_gib=16,
        ready_state=args.guest == "qemu",
        warm_pool_min=args.warm,
        warm_pool_max=args.warm,
        guest_without_kvm=args.guest,
    )
    await become_node_user(config, node_user(args.user), lambda _msg: None)
    node = await Node.start(config)
    settings = ControlSettings(data_dir=args.data_dir, database_url=args.database_url)
    server = asyncio.create_task(
        run_control_plane(settings, node, host="127.0.0.1", port=args.port)
    )
    try:
        _say_to_parent({"ready": True})
        await _serve_commands(node, args.guest)
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        await node.shutdown(unmount_pool=True)


# --- the parent: the REST side, interleaved with the child's --------------------------


class Platform:
    """The child process, its API and its command pipe."""

    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process = process
        self.client = httpx.Client(base_url=url, timeout=300)
        self.headers: dict[str, str] = {}
        self.e2b_headers: dict[str, str] = {}

    def use_key(self, key: str, data_dir: Path) -> None:
        self.headers = {"Authorization": f"Bearer {key}"}
        self.e2b_headers = {"X-API-KEY": key}
        self.paths = Paths(Api(str(self.client.base_url), key, data_dir))

    def node(self, **command: Any) -> float:
        """The child's own timing of ``command``, in ms."""
        stdin: IO[str] | None = self.process.stdin
        stdout: IO[str] | None = self.process.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()
        answer = _read_answer(stdout)
        if "error" in answer:
            raise RuntimeError(f"node {command['op']}: {answer['error']}")
        return float(answer["ms"])

    def create(self, guest: str) -> str:
        answer = self.client.post("/v1/sandboxes", json={"guest": guest}, headers=self.headers)
        answer.raise_for_status()
        return str(answer.json()["id"])

    def e2b_create(self) -> tuple[str, str]:
        # No network: gVisor sandboxes have no egress yet, and /v1's creates have none.
        body = {"templateID": "base", "timeout": 3600, "allow_internet_access": False}
        answer = self.client.post("/v2/sandboxes", json=body, headers=self.e2b_headers)
        if answer.is_error:
            raise RuntimeError(f"E2B create: {answer.status_code} {answer.text}")
        return str(answer.json()["sandboxID"]), str(answer.json()["envdAccessToken"])

    def delete(self, sandbox_id: str) -> None:
        self.client.delete(f"/v1/sandboxes/{sandbox_id}", headers=self.headers)

    def exec(self, sandbox_id: str) -> None:
        self.paths.ours_exec(sandbox_id)

    def e2b_start(self, sandbox_id: str, token: str) -> None:
        self.paths.e2b_exec(sandbox_id, token)

    def http_floor(self) -> None:
        if self.client.get("/bench-no-such-route").status_code != 404:
            raise RuntimeError("the HTTP floor's route answered")


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def _measured(p: Platform, figures: Figures, name: str, call: Callable[[], object]) -> None:
    """Run ``call``; record its wall time as ``name`` and the platform's CPU for it as
    ``name (cpu)`` (a node call is timed by the child itself)."""
    cpu = process_cpu_ms(p.process.pid)
    start = time.perf_counter()
    timed = call()
    wall = (time.perf_counter() - start) * 1000
    figures.setdefault(f"{name} (cpu)", []).append(process_cpu_ms(p.process.pid) - cpu)
    figures.setdefault(name, []).append(timed if isinstance(timed, float) else wall)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_listening(p: Platform, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            p.http_floor()
            return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@contextmanager
def platform(args: argparse.Namespace) -> Iterator[Platform]:
    with tempfile.TemporaryDirectory(prefix="space-bench-hostlat-") as tmp:
        os.chmod(tmp, 0o711)  # the node agent's user reaches its data dir
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        port = _free_port()
        command = [sys.executable, __file__, f"--child={data_dir}", f"--port={port}"]
        command += [f"--user={args.user}", f"--guest={args.guest}", f"--warm={args.warm}"]
        if args.database_url:
            command.append(f"--database-url={args.database_url}")
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert process.stdout is not None
            if "ready" not in _read_answer(process.stdout):
                raise RuntimeError("the platform did not start")
            served = Platform(process, f"http://127.0.0.1:{port}")
            _wait_listening(served)  # migrated by then: the key's tables exist
            settings = ControlSettings(data_dir=data_dir, database_url=args.database_url)
            served.use_key(create_key(settings, "bench"), data_dir)
            # The node is measured, not the tenant's quotas (as bench._platform does).
            set_quotas(settings, "bench", {quota.name: 1 << 40 for quota in QUOTAS})
            yield served
        finally:
            if process.stdin is not None:
                process.stdin.close()
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            leaked = release_data_dir(data_dir)
            if leaked:
                say(f"cleaned up leftovers: {leaked}")


Figures = dict[str, list[float]]


def _exec_rounds(p: Platform, guest: str, runs: int, figures: Figures, load: int) -> None:
    sandbox_id = p.create(guest)
    e2b_id, token = p.e2b_create()
    try:
        for _ in range(3):  # warm: the first execs pay for cold caches in the guest
            p.exec(sandbox_id)
            p.node(op="exec", id=sandbox_id)
        figures.setdefault(f"guest spawn, {load} idle", []).extend(
            p.node(op="guest_spawn", id=sandbox_id) for _ in range(3)
        )
        for _ in range(runs):
            _measured(p, figures, f"http floor, {load} idle", p.http_floor)
            _measured(
                p, figures, f"node exec, {load} idle", lambda: p.node(op="exec", id=sandbox_id)
            )
            _measured(p, figures, f"rest exec, {load} idle", lambda: p.exec(sandbox_id))
            _measured(p, figures, f"e2b start, {load} idle", lambda: p.e2b_start(e2b_id, token))
    finally:
        p.delete(sandbox_id)
        p.delete(e2b_id)


def _create_rounds(p: Platform, args: argparse.Namespace, figures: Figures, load: int) -> None:
    def refilled() -> None:
        if args.warm:
            time.sleep(args.refill_s)  # a warm pool VM is woken again (TCG: ~1-3 s)

    for i in range(args.creates):
        refilled()
        on_node = functools.partial(p.node, op="create", id=f"sb-bn{load}x{i}")
        _measured(p, figures, f"node create, {load} idle", on_node)
        p.node(op="delete", id=f"sb-bn{load}x{i}")
        refilled()
        made: list[str] = []
        create = functools.partial(_append, made, p.create, args.guest)
        _measured(p, figures, f"rest create, {load} idle", create)
        p.delete(made[0])


def _append(into: list[str], call: Callable[[str], str], arg: str) -> None:
    into.append(call(arg))


def run(args: argparse.Namespace) -> Figures:
    figures: Figures = {}
    with platform(args) as p:
        idle: list[str] = []
        try:
            for load in args.loads:
                while len(idle) < load:
                    idle.append(p.create(args.guest))
                say(f"{load} idle {args.guest} sandboxes: execs")
                _exec_rounds(p, args.guest, args.runs, figures, load)
                if args.creates:
                    say(f"{load} idle {args.guest} sandboxes: creates")
                    _create_rounds(p, args, figures, load)
        finally:
            for sandbox_id in idle:
                p.delete(sandbox_id)
    return figures


def _med(figures: Figures, name: str) -> float:
    return statistics.median(figures[name])


_CPU_FIGURES = ("http floor", "node exec", "rest exec", "e2b start", "node create", "rest create")


def report(figures: Figures, loads: list[int]) -> list[str]:
    lines = []
    for name, values in figures.items():
        lines.append(
            f"{name:<28} p50 {statistics.median(values):8.2f} ms"
            f"  p90 {percentile(values, 0.9):8.2f} ms  n={len(values)}"
        )
    for load in loads:
        guest = _med(figures, f"guest spawn, {load} idle")
        node = _med(figures, f"node exec, {load} idle")
        rest = _med(figures, f"rest exec, {load} idle")
        paired = [
            r - n
            for r, n in zip(
                figures[f"rest exec, {load} idle"], figures[f"node exec, {load} idle"], strict=True
            )
        ]
        lines.append(
            f"exec, {load} idle: guest {guest:.2f} | node {node - guest:+.2f}"
            f" | REST+DB {rest - node:+.2f} (paired p50 {statistics.median(paired):+.2f},"
            f" HTTP floor {_med(figures, f'http floor, {load} idle'):.2f}) ms;"
            f" round trip {rest / guest:.2f}x the guest's spawn"
        )
        cpu = {
            n: _med(figures, f"{n}, {load} idle (cpu)")
            for n in _CPU_FIGURES
            if f"{n}, {load} idle (cpu)" in figures
        }
        lines.append(
            f"platform CPU, {load} idle: exec REST+DB {cpu['rest exec'] - cpu['node exec']:+.2f}"
            f" | E2B Start {cpu['e2b start'] - cpu['node exec']:+.2f}"
            f" | HTTP floor {cpu['http floor']:.2f} ms over the node's own"
            + (
                f" | create {cpu['rest create'] - cpu['node create']:+.2f}"
                if "rest create" in cpu
                else ""
            )
        )
        if f"e2b start, {load} idle" in figures:
            e2b = _med(figures, f"e2b start, {load} idle")
            lines.append(f"e2b Start, {load} idle: {e2b - node:+.2f} ms over the node's exec")
        if f"rest create, {load} idle" in figures:
            made = _med(figures, f"node create, {load} idle")
            rest = _med(figures, f"rest create, {load} idle")
            lines.append(f"create, {load} idle: node {made:.1f} | REST+DB {rest - made:+.1f} ms")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--creates", type=int, default=8)
    parser.add_argument("--guest", choices=["gvisor", "qemu"], default="gvisor")
    parser.add_argument("--warm", type=int, default=0, help="warm pool size (qemu)")
    parser.add_argument("--refill-s", type=float, default=8.0, help="wait for the pool (qemu)")
    parser.add_argument("--loads", default="2,12", help="idle sandboxes, comma-separated")
    parser.add_argument("--database-url", default="", help="default: SQLite in the data dir")
    parser.add_argument("--user", default="space", help="the node agent's user")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        args.data_dir = args.child
        asyncio.run(child(args))
        return
    args.loads = [int(n) for n in args.loads.split(",")]
    figures = run(args)
    print("\n".join(report(figures, args.loads)))


if __name__ == "__main__":
    main()
