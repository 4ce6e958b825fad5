"""This checkout's embedded platform for benchmarks: `space serve` in a subprocess.

Like tests/integration/platform.py's ``running_platform``, but it runs this tree's code
(``python -m space.cli`` with the tree first on PYTHONPATH, also for the processes the
server spawns) and removes everything it made on exit instead of asserting.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.integration.conftest import release_data_dir
from tests.integration.platform import free_port, release

__all__ = ["Api", "embedded_platform", "say"]

ROOT = Path(__file__).resolve().parent.parent
#: This checkout's CLI, not whatever `space` script is on PATH (it may be another tree's).
SPACE_CLI = [sys.executable, "-m", "space.cli"]
#: The first start imports the base template and wakes its ready state: minutes on TCG.
READY_TIMEOUT_S = 600.0
_START_S = time.monotonic()


def say(message: str) -> None:
    """A progress line on stderr, stamped with the seconds since this module was loaded."""
    print(f"[{time.monotonic() - _START_S:7.1f} s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Api:
    url: str
    key: str
    data_dir: Path


def _cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"space serve exited early; see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/openapi.json", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"space serve not ready in {READY_TIMEOUT_S} s; see {log}")


def _create_key(data_dir: Path) -> str:
    out = subprocess.run(
        [*SPACE_CLI, "keys", "create", "--tenant", "bench", "--data-dir", str(data_dir)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
        env=_cli_env(),
        cwd=ROOT,
    )
    return out.stdout.strip().splitlines()[-1]


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@contextlib.contextmanager
def embedded_platform(data_dir: Path) -> Iterator[Api]:
    """`space serve` of this checkout on a fresh ``data_dir``. On exit, also on failure,
    the server is stopped and whatever it left under ``data_dir`` is removed (QEMUs,
    egress gateways, network namespaces, mounts, loop devices); leftovers are named on
    stderr. Sandboxes should be deleted through the API before: the server leaves VMs
    running when it stops."""
    data_dir.mkdir(parents=True)
    log_path = data_dir / "serve.log"
    port = free_port()
    # --release-pool: unmount the pool on exit when no VM is left (sandboxes deleted).
    command = [*SPACE_CLI, "serve", "--data-dir", str(data_dir), "--port", str(port)]
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [*command, "--release-pool"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_cli_env(),
            cwd=ROOT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, process, log_path)
        yield Api(url, _create_key(data_dir), data_dir)
    except BaseException:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        say("failed; the end of serve.log:\n" + "\n".join(tail))
        raise
    finally:
        _stop(process)
        leaked = release_data_dir(data_dir) + release(data_dir)
        if leaked:
            say(f"removed what the platform left: {leaked}")
