"""A real S3-compatible HTTP endpoint for the artifact store's tests: moto's server mode
(``python -m moto.server``), as a process of its own on loopback, killed afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

#: Credentials moto accepts (it checks none); never real ones.
ACCESS_KEY_ID = "testing-access-key"
SECRET_ACCESS_KEY = "testing-secret-key"
REGION = "us-east-1"


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def moto_server(*, host: str = "127.0.0.1", start_timeout_s: float = 30.0) -> Iterator[str]:
    """Start ``moto.server`` on a free port of ``host`` (loopback, or an address of a
    network the test made); yield its URL; kill it (its whole process group) on the way
    out, whatever happened, and check it is gone."""
    port = _free_port(host)
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID}
    env["AWS_SECRET_ACCESS_KEY"] = SECRET_ACCESS_KEY
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    url = f"http://{host}:{port}"
    try:
        _wait_until_up(process, url, start_timeout_s)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        assert process.returncode is not None, "the moto server outlived its fixture"


def _wait_until_up(process: subprocess.Popen[bytes], url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto server exited with {process.returncode} at start")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/moto-api/", timeout=1.0).status_code < 500:
                return
        time.sleep(0.1)
    raise RuntimeError(f"moto server not up at {url} after {timeout_s} s")
