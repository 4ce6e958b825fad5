"""``space demo``: the README's first session, timed step by step.

Against a running ``space serve`` (``--api-url``/``--api-key``), or ``--embedded``:
start ``space serve`` in a subprocess on a free loopback port, make an API key, run the
session, and stop the server again (SIGTERM, then SIGKILL after a deadline).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import httpx

from space.cli._common import ProgressPrinter, api_options, connection, reports_errors
from space.sdk import Sandbox, Template, allow
from space.sdk.errors import InternalError, SpaceError, Timeout, Unavailable

__all__ = ["demo", "run_demo"]

DEMO_CODE = "import platform; print(platform.python_version())"
DEMO_PATH = "/tmp/space-demo.txt"
DEMO_TEXT = "hello from SPACE\n"
#: A first ``space serve`` builds the base template (debootstrap): minutes, not seconds.
DEFAULT_START_TIMEOUT_S = 900.0
#: How long a stopping server gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 30.0


@click.command()
@api_options
@click.option("--embedded", is_flag=True, help="Start (and stop) a private `space serve`.")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/var/lib/space"),
    show_default=True,
    help="With --embedded: the server's data directory.",
)
@click.option("--start-timeout-s", default=DEFAULT_START_TIMEOUT_S, show_default=True)
@reports_errors
def demo(
    api_url: str | None,
    api_key: str | None,
    embedded: bool,
    data_dir: Path,
    start_timeout_s: float,
) -> None:
    """Create a sandbox, run Python, write and read a file, hibernate and wake it,
    snapshot and fork it, build a template and start a sandbox from it, delete
    everything; timed."""
    if not embedded:
        run_demo(click.echo, **connection(api_url, api_key))
        return
    with embedded_server(data_dir, start_timeout_s=start_timeout_s) as (url, key):
        run_demo(click.echo, api_url=url, api_key=key)


def run_demo(say: Callable[[str], None], **connect: Any) -> None:
    """The demo session; ``connect`` goes to Sandbox.create (api_url, api_key...)."""
    total = time.monotonic()
    with _step(say, "create sandbox") as note:
        sandbox = Sandbox.create(**connect)
        note(sandbox.sandbox_id)
    try:
        with _step(say, "run python3") as note:
            result = sandbox.commands.run(["python3", "-c", DEMO_CODE], check=True)
            note(f"Python {result.stdout.strip()}")
        with _step(say, f"write {DEMO_PATH}") as note:
            note(f"{sandbox.files.write(DEMO_PATH, DEMO_TEXT).size} bytes")
        with _step(say, f"read {DEMO_PATH}") as note:
            text = sandbox.files.read(DEMO_PATH)
            if text != DEMO_TEXT:
                raise InternalError(f"read back {text!r}, wrote {DEMO_TEXT!r}")
            note(repr(text))
        _egress_steps(say, sandbox)
        _lifecycle_steps(say, sandbox, connect)
    finally:
        with _step(say, "delete sandbox"):
            sandbox.kill()
    _template_steps(say, connect)
    say(f"done in {(time.monotonic() - total) * 1000:.0f} ms")


#: Prints what a name resolves to inside the sandbox (only the gateway is asked).
DEMO_RESOLVE = (
    "import socket, sys\n"
    "try: print(socket.gethostbyname(sys.argv[1]))\n"
    "except OSError as e: print('refused:', e.__class__.__name__)\n"
)


def _egress_steps(say: Callable[[str], None], sandbox: Sandbox) -> None:
    """No policy, no network; a policy opens exactly what it names. Only names are
    resolved (the gateway answers itself): the demo sends nothing off the host."""

    def resolve(name: str) -> str:
        result = sandbox.commands.run(["python3", "-c", DEMO_RESOLVE, name], check=True)
        return result.stdout.strip()

    with _step(say, "egress: no policy") as note:
        note(f"pypi.org -> {resolve('pypi.org')}")
    with _step(say, "egress: allow pypi.org") as note:
        sandbox.network.set_policy(allow("pypi.org:443"))
        note(f"pypi.org -> {resolve('pypi.org')}, example.com -> {resolve('example.com')}")
    with _step(say, "egress log") as note:
        denied = [e for e in sandbox.network.log(limit=20) if e.decision == "deny"]
        note(
            f"{len(denied)} refused, e.g. {denied[-1].host}: {denied[-1].reason}" if denied else ""
        )


def _lifecycle_steps(say: Callable[[str], None], sandbox: Sandbox, connect: dict[str, Any]) -> None:
    """Hibernate and wake, snapshot, fork: the sandbox's life beyond one boot."""
    with _step(say, "hibernate"):
        sandbox.hibernate()
    with _step(say, f"wake by reading {DEMO_PATH}") as note:
        note(repr(sandbox.files.read(DEMO_PATH)))
    with _step(say, "snapshot") as note:
        snapshot = sandbox.snapshot("demo")
        note(snapshot.snapshot_id)
    try:
        with _step(say, "fork") as note:
            (child,) = sandbox.fork(1)
            note(f"{child.sandbox_id} reads {child.files.read(DEMO_PATH)!r}")
        child.kill()
    finally:
        Sandbox.delete_snapshot(snapshot, **connect)


DEMO_SPEC = """\
name = "demo"
base = "debian:bookworm"
env = { GREETING = "hello from a template" }
workdir = "/opt/demo"
start = "python3 -m http.server 8000 --bind 127.0.0.1"

[[steps]]
copy = { src = "greet.py", dst = "/opt/demo/greet.py" }

[[steps]]
run = "python3 -m compileall -q /opt/demo"
"""
DEMO_GREET = "import os; print(os.environ['GREETING'], 'in', os.getcwd())\n"


def _template_steps(say: Callable[[str], None], connect: dict[str, Any]) -> None:
    """Build a template from a spec, start a sandbox from its ready state, remove both."""
    with tempfile.TemporaryDirectory(prefix="space-demo-") as tmp:
        (Path(tmp) / "space.toml").write_text(DEMO_SPEC)
        (Path(tmp) / "greet.py").write_text(DEMO_GREET)
        with _step(say, "build template demo") as note:
            built = Template.build(Path(tmp), **connect)
            note(f"{built.ref} {built.digest[:12]}")
    try:
        with _step(say, "create from template") as note:
            sandbox = Sandbox.create("demo", **connect)
            note(sandbox.sandbox_id)
        try:
            with _step(say, "run its greet.py") as note:
                result = sandbox.commands.run(["python3", "greet.py"], check=True)
                note(result.stdout.strip())
        finally:
            sandbox.kill()
    finally:
        Template.delete("demo", **connect)


@contextlib.contextmanager
def _step(say: Callable[[str], None], name: str) -> Iterator[Callable[[str], None]]:
    notes: list[str] = []
    started = time.monotonic()
    yield notes.append
    elapsed_ms = (time.monotonic() - started) * 1000
    detail = f": {', '.join(notes)}" if notes else ""
    say(f"{name:<28} {elapsed_ms:8.0f} ms{detail}")


@contextlib.contextmanager
def embedded_server(data_dir: Path, *, start_timeout_s: float) -> Iterator[tuple[str, str]]:
    """Run ``space serve`` on a free loopback port; yield (API URL, API key).

    The server's progress and logs go to this process's stderr. On exit (or failure)
    the server gets SIGTERM, then SIGKILL after STOP_GRACE_S; it is always reaped.
    """
    progress = ProgressPrinter()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # --release-pool: a demo should not leave the pool's loop mount behind once idle.
    command = [sys.executable, "-m", "space.cli", "serve", "--release-pool", "--data-dir"]
    progress(f"starting space serve on {url} (data in {data_dir})")
    # The user's environment on purpose (issue 18 looked at it): the demo runs the user's
    # own server, which reads SPACE_MASTER_KEY from it if set; the platform's own
    # children get child_environment() (space/node/core/environment.py).
    server = subprocess.Popen(
        [*command, str(data_dir), "--host", "127.0.0.1", "--port", str(port)], stdout=sys.stderr
    )
    try:
        _wait_until(lambda: _answers(f"{url}/openapi.json"), server, start_timeout_s)
        progress("server ready; creating an API key")
        key = _create_key(data_dir)
        _wait_until(lambda: _answers(f"{url}/v1/sandboxes", key), server, 30.0)
        yield url, key
    finally:
        progress("stopping space serve")
        _stop(server)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _answers(url: str, key: str | None = None) -> bool:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        return httpx.get(url, headers=headers, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_until(ready: Callable[[], bool], server: subprocess.Popen[bytes], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not ready():
        if server.poll() is not None:
            raise Unavailable(f"space serve exited with status {server.returncode}")
        if time.monotonic() > deadline:
            raise Timeout(f"space serve was not ready within {limit_s:.0f} s")
        time.sleep(0.25)


def _create_key(data_dir: Path) -> str:
    command = [sys.executable, "-m", "space.cli", "keys", "create", "--tenant", "demo"]
    try:
        done = subprocess.run(
            [*command, "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        raise Timeout("space keys create did not finish within 60 s") from None
    lines = done.stdout.split()
    if done.returncode != 0 or not lines:
        raise SpaceError(f"space keys create failed: {done.stderr.strip() or done.returncode}")
    return lines[-1]


def _stop(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            server.kill()
    server.wait()
