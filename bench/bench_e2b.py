"""Benchmark of the E2B path (issue 20) beside our own API, in one run.

Starts its own embedded platform and measures, with one HTTP client for both paths so
that the difference is the translation alone:

- exec round trip of ``true``: ``POST /v1/sandboxes/{id}/exec`` (NDJSON) against E2B's
  ``process.Process/Start`` (Connect, server-streaming) addressed by the
  ``E2b-Sandbox-Id``/``-Port`` headers, on the same sandbox, interleaved;
- create (to running): ``POST /v1/sandboxes`` against ``POST /v2/sandboxes``, of the
  same sandbox (E2B's default: internet egress, ports on with the token);

each with a few sandboxes on the node and again with ``--load`` more idle ones, and the
real SDKs end to end: E2B's ``Sandbox.commands.run`` (in ``.venv-e2b``) against ours.
Prints medians, p90 and the added milliseconds (target: the translation adds <= 2 ms
p50). Usage: ``PYTHONPATH=. .venv/bin/python bench/bench_e2b.py [--runs 40] [--load 12]``
as root. Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._platform import Api, embedded_platform, say
from space import Sandbox
from space.control.e2b import INTERNET
from tests.e2b_sdk import E2B_VENV, e2b_environment


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(q * len(ordered)) - 1)]


def _line(name: str, ours: list[float], e2b: list[float]) -> str:
    a, b = statistics.median(ours), statistics.median(e2b)
    return (
        f"{name:<30} ours p50 {a:8.2f} ms p90 {_p(ours, 0.9):8.2f}"
        f" | e2b p50 {b:8.2f} ms p90 {_p(e2b, 0.9):8.2f}"
        f" | added {b - a:+7.2f} ms ({b / a:.2f}x)"
    )


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def _envelope(message: dict[str, object]) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(data)) + data


class Paths:
    """Both APIs through one client."""

    def __init__(self, api: Api) -> None:
        self.client = httpx.Client(base_url=api.url, timeout=120)
        self.key = {"Authorization": f"Bearer {api.key}"}
        self.e2b_key = {"X-API-KEY": api.key}

    def ours_create(self) -> str:
        """The sandbox E2B's default create makes (space.control.e2b), through /v1."""
        body = {"timeout_s": 3600, "egress": {"allow": list(INTERNET)}, "ports": {"enabled": True}}
        answer = self.client.post("/v1/sandboxes", json=body, headers=self.key)
        answer.raise_for_status()
        return str(answer.json()["id"])

    def e2b_create(self) -> tuple[str, str]:
        body = {"templateID": "base", "timeout": 3600}
        answer = self.client.post("/v2/sandboxes", json=body, headers=self.e2b_key)
        answer.raise_for_status()
        created = answer.json()
        return str(created["sandboxID"]), str(created["envdAccessToken"])

    def delete(self, sandbox_id: str) -> None:
        self.client.delete(f"/v1/sandboxes/{sandbox_id}", headers=self.key)

    def ours_exec(self, sandbox_id: str) -> None:
        body = {"argv": ["true"]}
        with self.client.stream(
            "POST", f"/v1/sandboxes/{sandbox_id}/exec", json=body, headers=self.key
        ) as answer:
            answer.raise_for_status()
            lines = [json.loads(line) for line in answer.iter_lines() if line]
        assert lines[-1].get("exit_code") == 0, lines[-1]

    def e2b_exec(self, sandbox_id: str, token: str) -> None:
        headers = {
            "E2b-Sandbox-Id": sandbox_id,
            "E2b-Sandbox-Port": "49983",
            "X-Access-Token": token,
            "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1",
        }
        body = _envelope({"process": {"cmd": "true"}})
        with self.client.stream(
            "POST", "/process.Process/Start", content=body, headers=headers
        ) as answer:
            answer.raise_for_status()
            messages = _envelopes(answer.read())
        # The stream ends with an end-of-stream envelope (flag 2) without an error,
        # after the process's end event (exit code 0 is protobuf JSON's default: absent).
        (flags, last), (_, end) = messages[-1], messages[-2]
        assert flags & 2 and last == {}, last
        assert end["event"]["end"].get("exitCode", 0) == 0, end


def _envelopes(data: bytes) -> list[tuple[int, dict[str, Any]]]:
    messages, offset = [], 0
    while offset < len(data):
        flags, size = struct.unpack(">BI", data[offset : offset + 5])
        messages.append((flags, json.loads(data[offset + 5 : offset + 5 + size])))
        offset += 5 + size
    return messages


def _exec_rounds(paths: Paths, runs: int) -> tuple[list[float], list[float]]:
    sandbox_id, token = paths.e2b_create()
    try:
        paths.ours_exec(sandbox_id)
        paths.e2b_exec(sandbox_id, token)
        ours, e2b = [], []
        for _ in range(runs):  # interleaved: both see the same load and the same guest
            ours.append(_timed(lambda: paths.ours_exec(sandbox_id)))
            e2b.append(_timed(lambda: paths.e2b_exec(sandbox_id, token)))
        return ours, e2b
    finally:
        paths.delete(sandbox_id)


def _create_rounds(paths: Paths, runs: int) -> tuple[list[float], list[float]]:
    ours, e2b = [], []
    made: list[str] = []
    try:
        for _ in range(runs):
            start = time.perf_counter()
            made.append(paths.ours_create())
            ours.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            made.append(paths.e2b_create()[0])
            e2b.append((time.perf_counter() - start) * 1000)
            for sandbox_id in made[-2:]:
                paths.delete(sandbox_id)
    finally:
        for sandbox_id in made:
            paths.delete(sandbox_id)
    return ours, e2b


_SDK_SCRIPT = """
import json, statistics, sys, time
from e2b import Sandbox
sandbox = Sandbox.create("base", timeout=3600)
sandbox.commands.run("true")
times = []
for _ in range({runs}):
    start = time.perf_counter()
    sandbox.commands.run("true")
    times.append((time.perf_counter() - start) * 1000)
sandbox.kill()
print(json.dumps(times))
"""


def _sdk_rounds(api: Api, runs: int) -> tuple[list[float], list[float]]:
    done = subprocess.run(
        [str(E2B_VENV / "bin" / "python"), "-c", _SDK_SCRIPT.format(runs=runs)],
        env=e2b_environment(api.url, api.key),
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    e2b = [float(value) for value in json.loads(done.stdout.strip().splitlines()[-1])]
    sandbox = Sandbox.create(api_url=api.url, api_key=api.key)
    try:
        sandbox.commands.run(["true"])
        ours = [_timed(lambda: sandbox.commands.run(["true"])) for _ in range(runs)]
    finally:
        sandbox.kill()
    return ours, e2b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--creates", type=int, default=6)
    parser.add_argument("--load", type=int, default=12, help="idle sandboxes for the loaded run")
    args = parser.parse_args()
    lines: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="space-bench-") as tmp,
        embedded_platform(Path(tmp) / "data") as api,
    ):
        paths = Paths(api)
        idle: list[str] = []
        try:
            for load in (2, args.load):
                while len(idle) < load:
                    idle.append(paths.ours_create())
                say(f"{load} idle sandboxes: exec")
                ours, e2b = _exec_rounds(paths, args.runs)
                lines.append(_line(f"exec true, {load} idle", ours, e2b))
                say(f"{load} idle sandboxes: create")
                ours, e2b = _create_rounds(paths, args.creates)
                lines.append(_line(f"create, {load} idle", ours, e2b))
            say("the SDKs end to end")
            for sandbox_id in idle[2:]:
                paths.delete(sandbox_id)
            del idle[2:]
            ours, e2b = _sdk_rounds(api, args.runs)
            lines.append(_line("SDK commands.run('true'), 2 idle", ours, e2b))
        finally:
            for sandbox_id in idle:
                paths.delete(sandbox_id)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
