"""Run spaced as a real subprocess in --stdio mode and connect a GuestChannel to it."""

from __future__ import annotations

import asyncio
import getpass
import json
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

from space.node.channel import GuestChannel


class NonClosingWriter:
    """Lets a test drop one GuestChannel and open another on the same pipes."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self.transport = writer.transport

    def write(self, data: bytes) -> None:
        self._writer.write(data)

    async def drain(self) -> None:
        await self._writer.drain()

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass


class Guest:
    def __init__(self, proc: asyncio.subprocess.Process, home: Path, identity_record: Path) -> None:
        self.proc = proc
        self.home = home
        #: Where --stdio spaced records the identity changes it would make.
        self.identity_record = identity_record

    def identity_changes(self) -> list[dict[str, object]]:
        """The recorded system.identity changes, oldest first."""
        if not self.identity_record.exists():
            return []
        lines = self.identity_record.read_text().splitlines()
        return [json.loads(line) for line in lines]

    async def channel(self, sandbox_id: str = "sb-test", **timing: Any) -> GuestChannel:
        """A new channel (a new session); ``timing``: GuestChannel.open's silence_timeout_s
        and ping_interval_s."""
        assert self.proc.stdout is not None and self.proc.stdin is not None
        writer = cast(asyncio.StreamWriter, NonClosingWriter(self.proc.stdin))
        return await GuestChannel.open(
            self.proc.stdout, writer, sandbox_id=sandbox_id, hello_timeout_s=10, **timing
        )

    def vm_hwm_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM")


@asynccontextmanager
async def running_guest(home: Path) -> AsyncIterator[Guest]:
    """Start spaced; on exit close its stdin and check that it (and its children) ended."""
    with tempfile.TemporaryDirectory(prefix="spaced-identity-") as record_dir:
        identity_record = Path(record_dir) / "identity.jsonl"
        async with _spaced(home, identity_record) as proc:
            yield Guest(proc, home, identity_record)


@asynccontextmanager
async def _spaced(home: Path, identity_record: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-B",
        "-m",
        "space.guest",
        "--stdio",
        "--identity-record",
        str(identity_record),
        "--user-default",
        getpass.getuser(),
        "--home-default",
        str(home),
        "--log-level",
        "WARNING",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        yield proc
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        # Python 3.11's Process.wait() returns only once every pipe is at EOF: frames
        # spaced sent that no closed channel read (a stalled tunnel's window) would
        # pause the stdout transport and hold wait() after spaced has gone.
        drained = asyncio.create_task(_drain(proc.stdout))
        try:
            async with asyncio.timeout(10):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError("spaced did not exit at EOF") from None
        finally:
            await drained
    assert proc.returncode == 0


async def _drain(stdout: asyncio.StreamReader) -> None:
    """Read ``stdout`` to its end, dropping what comes; a channel still reading it
    (RuntimeError: another reader) does so itself."""
    try:
        while await stdout.read(1 << 16):
            pass
    except (RuntimeError, ConnectionError):
        pass


def run_with_channel(home: Path, body: Callable[[GuestChannel, Guest], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async with running_guest(home) as guest:
            channel = await guest.channel()
            try:
                return await body(channel, guest)
            finally:
                await channel.close()

    return asyncio.run(main())
