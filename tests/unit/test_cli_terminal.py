"""``space exec -it`` and ``-i`` (issue 20): a PTY the size of our terminal, raw mode
restored; stdin streamed in pieces."""

from __future__ import annotations

import fcntl
import io
import os
import struct
import termios

from space.cli._terminal import _feed, run_terminal, stdin_reader
from space.sdk import Sandbox
from space.sdk.errors import Conflict
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


class _Handle:
    def __init__(self, refuse_after: int | None = None) -> None:
        self.sent: list[bytes] = []
        self.closed = False
        self._refuse_after = refuse_after

    def send_stdin(self, data: bytes) -> None:
        if self._refuse_after is not None and len(self.sent) >= self._refuse_after:
            raise Conflict("the process has exited")
        self.sent.append(data)

    def close_stdin(self) -> None:
        if self._refuse_after is not None and len(self.sent) >= self._refuse_after:
            raise Conflict("the process has exited")
        self.closed = True


def test_exec_i_streams_stdin_in_pieces_then_closes_it() -> None:
    data = os.urandom(200_000)  # several reads
    handle = _Handle()
    _feed(handle, stdin_reader(io.BufferedReader(io.BytesIO(data))))  # type: ignore[arg-type]
    assert b"".join(handle.sent) == data and len(handle.sent) > 1 and handle.closed


def test_negative_exec_i_stops_feeding_a_command_that_ended_first() -> None:
    handle = _Handle(refuse_after=1)
    read_fd, write_fd = os.pipe()  # a real descriptor: read with os.read
    os.write(write_fd, os.urandom(60_000))
    os.close(write_fd)
    with open(read_fd, "rb") as stdin:
        _feed(handle, stdin_reader(stdin))  # type: ignore[arg-type]
    assert len(handle.sent) == 1 and not handle.closed
