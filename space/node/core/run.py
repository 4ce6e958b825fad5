"""Run a host command with a deadline and bounded output; failures become node errors."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from space.node.api import Timeout, Unavailable
from space.node.core.environment import child_environment

__all__ = ["command_lines", "kill_group", "run"]

_MAX_OUTPUT_BYTES = 64 * 1024


async def run(
    *argv: str,
    timeout_s: float = 60.0,
    check: bool = True,
    stdin: str | None = None,
    pass_fds: tuple[int, ...] = (),
) -> str:
    """Run ``argv`` (no shell) with ``stdin`` as its input (None: /dev/null), return its
    stdout decoded (at most 64 KiB kept).

    Raises Unavailable if the program is missing or (with ``check``) exits non-zero,
    the message carrying its stderr; Timeout if it runs past ``timeout_s``, in which
    case its process group has been killed. Cancellation kills it too. The program
    gets child_environment(), never the node's own (issue 18), and of the node's
    descriptors ``pass_fds`` only.
    """
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            env=child_environment(),
            pass_fds=pass_fds,
        )
    except OSError as exc:
        raise Unavailable(f"cannot run {argv[0]}: {exc}") from exc
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate(None if stdin is None else stdin.encode())
    except TimeoutError:
        raise Timeout(f"{' '.join(argv)} did not finish within {timeout_s} s") from None
    finally:
        await kill_group(proc)
    if check and proc.returncode != 0:
        detail = err[-_MAX_OUTPUT_BYTES:].decode(errors="replace").strip()
        raise Unavailable(f"{' '.join(argv)} failed ({proc.returncode}): {detail}")
    return out[:_MAX_OUTPUT_BYTES].decode(errors="replace")


async def kill_group(proc: asyncio.subprocess.Process) -> None:
    """Kill the process group of ``proc`` (started in a session of its own) unless it
    has exited, and reap it; idempotent."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


def command_lines() -> Iterator[tuple[int, bytes]]:
    """(pid, NUL-separated argv) of every process /proc shows now; one that is gone by
    the time it is read is skipped."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            yield int(proc.name), (proc / "cmdline").read_bytes()
        except OSError:
            continue
