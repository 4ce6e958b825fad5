"""A real, throwaway PostgreSQL server for tests (issue 19).

``PostgresCluster.start`` runs Debian's binaries (``/usr/lib/postgresql/<newest>/bin``):
``initdb`` makes a cluster in a new temporary directory and ``pg_ctl`` starts it, on a
unix socket in that directory and on 127.0.0.1 at a free port only. PostgreSQL refuses
to run as root, so under root both run as the ``postgres`` user the package makes (or
setup's ``space`` user), which owns the directory. Authentication is ``trust``: only
this machine's loopback and that socket reach it, for the few seconds a test session
lasts. ``database()`` hands out a fresh database; ``stop`` stops the server (SIGKILL
if it will not stop) and removes the directory, and checks no server process is left.

Without the package installed, ``start`` fails the test loudly: setup installs it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from space.control.store import Database
from tests.ports import free_port

__all__ = ["PostgresCluster", "postgres_bin"]

_ROOT = Path("/usr/lib/postgresql")
#: The superuser initdb makes, whom every test connection logs in as.
ROLE = "space"
_COMMAND_TIMEOUT_S = 60


def postgres_bin() -> Path:
    """The bin directory of the newest PostgreSQL installed; fails the test without one."""
    found = sorted(
        (int(path.parent.parent.name), path.parent)
        for path in _ROOT.glob("*/bin/initdb")
        if path.parent.parent.name.isdigit()
    )
    if not found:
        pytest.fail(
            f"PostgreSQL is not installed (no {_ROOT}/<version>/bin/initdb): run scripts/setup.sh,"
            " which installs Debian's postgresql package",
            pytrace=False,
        )
    return found[-1][1]


def _server_user() -> str | None:
    """The user the server runs as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "space"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    pytest.fail("no 'postgres' or 'space' user to run PostgreSQL as: run scripts/setup.sh")


class PostgresCluster:
    """One PostgreSQL server in a temporary directory (see the module docstring)."""

    def __init__(self) -> None:
        self.bin = postgres_bin()
        self.user = _server_user()
        self.root = Path(tempfile.mkdtemp(prefix="space-pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root / "run"
        self.port = free_port()
        self._pid: int | None = None
        #: A database at the newest schema that ``database(migrated=True)`` copies.
        self._template: str | None = None

    def _run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / argv[0]), *argv[1:]]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        try:
            return subprocess.run(
                command,
                capture_output=True,
                text=True,
                check=True,
                timeout=_COMMAND_TIMEOUT_S,
                cwd=self.root,
            )
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(
                f"{argv[0]} failed ({exc.returncode}): {exc.stderr[-2000:]}"
            ) from exc

    def start(self) -> None:
        """initdb and start the server; raises RuntimeError (with its log) if it fails."""
        self.socket_dir.mkdir()
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            for path in (self.root, self.socket_dir):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._run(
            "initdb", "-D", str(self.data), "-U", ROLE, "-A", "trust", "-E", "UTF8", "--no-sync"
        )
        options = (
            f"-k {self.socket_dir} -p {self.port} -c listen_addresses=127.0.0.1"
            # A test server: losing its data in a host crash costs nothing.
            " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        log = self.root / "server.log"
        try:
            self._run("pg_ctl", "start", "-D", str(self.data), "-l", str(log), "-w", "-o", options)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{_tail(log)}") from exc
        self._pid = int((self.data / "postmaster.pid").read_text().split()[0])

    def url(self, database: str = "postgres", *, over_socket: bool = False) -> str:
        """A SQLAlchemy URL of ``database``, over TCP on 127.0.0.1 or the unix socket."""
        if over_socket:
            return f"postgresql://{ROLE}@/{database}?host={self.socket_dir}&port={self.port}"
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{database}"

    def _admin(self, statement: str) -> None:
        conninfo = f"host=127.0.0.1 port={self.port} user={ROLE} dbname=postgres"
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=10) as connection:
            connection.execute(statement)

    @contextlib.contextmanager
    def database(self, *, migrated: bool = False) -> Iterator[str]:
        """A new database's URL, dropped on exit (its connections closed by force):
        empty, or with ``migrated`` a copy of one at the newest schema (tests/schema.py
        says why), made by the server from a template migrated on first use."""
        name = "t_" + secrets.token_hex(6)
        template = f' TEMPLATE "{self._migrated_template()}"' if migrated else ""
        self._admin(f'CREATE DATABASE "{name}"{template}')
        try:
            yield self.url(name)
        finally:
            self._admin(f'DROP DATABASE "{name}" WITH (FORCE)')

    def _migrated_template(self) -> str:
        if self._template is None:
            name = "template_" + secrets.token_hex(6)
            self._admin(f'CREATE DATABASE "{name}"')
            db = Database(self.url(name))
            try:
                db.upgrade()
            finally:
                db.dispose()  # CREATE DATABASE … TEMPLATE wants no one connected to it
            self._template = name
        return self._template

    def stop(self) -> None:
        """Stop the server (killed if a fast shutdown fails) and remove its directory.

        Raises AssertionError if its process is still there afterwards.
        """
        try:
            if self._pid is not None:
                try:
                    self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "fast", "-w")
                except (RuntimeError, subprocess.TimeoutExpired):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self._pid, signal.SIGKILL)
                _wait_gone(self._pid)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"the PostgreSQL server (pid {pid}) is still running")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    # Not our child (pg_ctl started it, detached): look at /proc, zombies count as gone.
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    state = re.search(r"^State:\s+(\S)", status, re.MULTILINE)
    return state is not None and state.group(1) != "Z"


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"
