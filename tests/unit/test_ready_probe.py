"""The ready check's probe (space/node/agent/_hidden.py), run on the host's python3 as
the guest runs it: against a real HTTP server on 127.0.0.1 and real commands."""

from __future__ import annotations

import contextlib
import http.server
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.node.agent._hidden import _READY_PROBE


def _probe(timeout_s: float, *target: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", _READY_PROBE, str(timeout_s), "0.1", "2", *target]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def server() -> Iterator[tuple[int, list[int]]]:
    """A server whose /health answers the statuses in the list, one per request."""
    statuses = [503, 503, 200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
            self.send_response(status if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            del format, args

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1], statuses
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_an_http_check_passes_once_the_path_answers_2xx(server: tuple[int, list[int]]) -> None:
    port, statuses = server
    assert _probe(30, "http", str(port), "/health").returncode == 0
    assert statuses == [200]  # it asked until the 200


def test_negative_an_http_check_that_never_answers_2xx_fails_with_the_last_status(
    server: tuple[int, list[int]],
) -> None:
    port, _ = server
    done = _probe(1, "http", str(port), "/missing")
    assert done.returncode == 1 and "404" in done.stdout


def test_a_command_check_passes_once_it_exits_0(tmp_path: Path) -> None:
    flag = tmp_path / "up"
    command = f"if [ -e {flag} ]; then exit 0; fi; touch {flag}; exit 3"
    assert _probe(30, "command", command).returncode == 0


def test_negative_a_command_check_that_keeps_failing_says_its_exit_code_and_output() -> None:
    done = _probe(1, "command", "echo not yet; exit 7")
    assert done.returncode == 1
    assert "exit code 7: not yet" in done.stdout


def test_negative_nothing_listening_fails_within_the_timeout() -> None:
    with socket_port() as port:
        done = _probe(1, "http", str(port), "/")
    assert done.returncode == 1 and "Connection refused" in done.stdout


@contextlib.contextmanager
def socket_port() -> Iterator[int]:
    """A loopback port nothing listens on (bound, not listening, while in use)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]
