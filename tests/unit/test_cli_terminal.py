"""``space exec -it`` (issue 20): a PTY the size of our terminal, raw mode restored."""

from __future__ import annotations

import fcntl
import os
import struct
import termios

from space.cli._terminal import run_terminal
from space.sdk import Sandbox
from tests.unit._live_api import LiveApi
from tests.unit.test_cli import _space, fake, sid

__all__ = ["fake", "sid"]  # the fixtures, shared with test_cli


def test_exec_it_runs_on_a_pty_of_the_terminals_size_and_restores_the_terminal(
    fake: LiveApi, sid: str
) -> None:
    fake.scripts["bash"] = [("stdout", b"prompt$ "), ("exit", 3, None, False)]
    master, slave = os.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 77, 0, 0))
        before = termios.tcgetattr(slave)
        out: list[str] = []
        sandbox = Sandbox.connect(sid, **fake.connection())
        try:
            result = run_terminal(
                sandbox, "bash", env={}, cwd=None, user=None, timeout_s=None,
                stdin_fd=slave, write=out.append,
            )  # fmt: skip
        finally:
            sandbox.close()
        assert termios.tcgetattr(slave) == before
    finally:
        os.close(master)
        os.close(slave)
    assert fake.exec_bodies[-1]["pty"] == {"rows": 33, "cols": 77}
    assert ("".join(out), result.exit_code) == ("prompt$ ", 3)


def test_negative_exec_t_without_a_terminal_exits_2_and_runs_nothing(
    fake: LiveApi, sid: str
) -> None:
    result = _space(fake, "exec", sid, "-it", "--", "bash", stdin=b"")
    assert result.exit_code == 2 and "terminal" in result.output
    assert fake.exec_bodies == []
