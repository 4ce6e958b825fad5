"""Benchmark of the egress gateway: the latency it adds per request, and throughput.

A sandbox namespace is made exactly as the node makes one (space.node.network.netns),
its nftables and the gateway process included, but its ``tap0`` is one end of a veth
pair whose other end is in a "guest" namespace: the client there runs at host speed,
so the figures are the gateway's and not TCG's. Upstream is tests/egress_world.py's
little internet (servers in a namespace of their own).

Side by side, interleaved, one new connection per request:

- direct: the same client in the host's namespace, straight to the server;
- relay: through the gateway by a CIDR rule (plain TCP relay, nothing parsed);
- http: through the gateway by name (DNS synthetic address, pinning, mitmproxy HTTP);
- https: through the gateway by name, TLS terminated with the sandbox CA and verified
  upstream (direct: TLS straight to the server).

Prints the median and p90 per path, the median added over direct, and the throughput
of a 64 MiB download each way. Everything is removed at the end, also on failure.
Usage: `.venv/bin/python bench/bench_egress.py [--runs 200]` as root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._stats import summary
from space.node.network import ca, netns
from space.node.network.gateway_client import GatewayProcess
from space.node.privileged import Scope, start_broker
from tests.egress_world import UPSTREAM, World, egress_world

CLIENT = Path(__file__).with_name("_egress_client.py")
DOWNLOAD = 64 << 20
POLICY = {
    "allow": [
        {"domain": "allowed.test", "ports": [80, 443]},
        {"cidr": f"{UPSTREAM}/32", "ports": [8080]},
    ]
}


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def client(netns_name: str | None, **args: object) -> list[tuple[float, int]]:
    argv = [sys.executable, str(CLIENT), json.dumps(args)]
    if netns_name is not None:
        argv = ["ip", "netns", "exec", netns_name, *argv]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return [(float(t), int(n)) for t, n in json.loads(out)]


def paths(world: World, sandbox_ca: Path) -> dict[str, tuple[bool, dict[str, object]]]:
    """name -> (through the gateway?, client arguments)."""
    common: dict[str, object] = {"dns": netns.GATEWAY_ADDRESS, "ca": None}
    return {
        "direct http": (False, {**common, "address": UPSTREAM, "port": 80, "host": "allowed.test"}),
        "relay (cidr rule)": (True, {**common, "address": UPSTREAM, "port": 8080, "host": "x"}),
        "http by name": (True, {**common, "address": None, "port": 80, "host": "allowed.test"}),
        "direct https": (
            False,
            {
                **common,
                "address": UPSTREAM,
                "port": 443,
                "host": "allowed.test",
                "ca": str(world.upstream_ca),
            },
        ),
        "https by name": (
            True,
            {**common, "address": None, "port": 443, "host": "allowed.test", "ca": str(sandbox_ca)},
        ),
    }


async def bench(world: World, runs: int, work: Path) -> None:
    run_root = work / "run"
    name = netns.netns_name(run_root / "bench")
    guest = f"spbg-{secrets.token_hex(3)}"
    broker = await start_broker(Scope(run_root, (work,)))
    gateway = await GatewayProcess.start(
        work / "egress", [world.resolver], world.upstream_ca, broker=broker
    )
    try:
        await netns.create(run_root, name)
        sh("ip", "netns", "add", guest)
        sh("ip", "-n", name, "link", "del", netns.TAP)
        sh("ip", "link", "add", "eth0", "netns", guest, "type", "veth",
           "peer", "name", netns.TAP, "netns", name)  # fmt: skip
        sh("ip", "-n", name, "addr", "add", f"{netns.GATEWAY_ADDRESS}/30", "dev", netns.TAP)
        sh("ip", "-n", name, "link", "set", netns.TAP, "up")
        sh("ip", "-n", guest, "addr", "add", f"{netns.GUEST_ADDRESS}/30", "dev", "eth0")
        sh("ip", "-n", guest, "link", "set", "eth0", "up")
        sh("ip", "-n", guest, "route", "add", "default", "via", netns.GATEWAY_ADDRESS)
        ca_file = ca.ensure_ca(work / "ca", "bench")
        (work / "guest-ca.pem").write_bytes(ca.certificate_pem(ca_file))
        await gateway.attach("bench", netns.netns_path(name), POLICY, ca_file)
        await netns.set_open(run_root, name, True)
        measure(world, guest, work / "guest-ca.pem", runs)
    finally:
        await gateway.detach("bench")
        await gateway.close()  # nothing attached: the gateway ends
        sh("ip", "netns", "delete", guest)
        await netns.delete(run_root, name)
        await broker.close()


def measure(world: World, guest: str, sandbox_ca: Path, runs: int) -> None:
    chosen = paths(world, sandbox_ca)
    times: dict[str, list[float]] = {label: [] for label in chosen}
    batch = 10
    for _ in range(max(1, runs // batch)):  # interleaved batches: drift hits all alike
        for label, (gated, args) in chosen.items():
            got = client(guest if gated else None, count=batch, path="/", **args)
            times[label] += [t * 1000 for t, _ in got]
    print(f"Per request, a new connection each ({runs} runs):")
    for label, values in times.items():
        print(summary(label, values, "ms"))
    pairs = [
        ("http by name", "direct http"),
        ("relay (cidr rule)", "direct http"),
        ("https by name", "direct https"),
    ]
    for through, direct in pairs:
        added = statistics.median(times[through]) - statistics.median(times[direct])
        ratio = statistics.median(times[through]) / statistics.median(times[direct])
        print(f"  {through:<20} adds {added:7.2f} ms over {direct} ({ratio:.1f}x)")
    print(f"Download of {DOWNLOAD >> 20} MiB (median of 3):")
    for label, (gated, args) in chosen.items():
        got = client(guest if gated else None, count=3, path=f"/bytes/{DOWNLOAD}", **args)
        assert all(size > DOWNLOAD for _, size in got), got
        rate = statistics.median(DOWNLOAD / t / (1 << 20) for t, _ in got)
        print(f"  {label:<20} {rate:8.1f} MiB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    with egress_world() as world, tempfile.TemporaryDirectory(prefix="space-bench-") as work:
        world.records["allowed.test"] = [UPSTREAM]
        asyncio.run(bench(world, args.runs, Path(work)))


if __name__ == "__main__":
    main()
