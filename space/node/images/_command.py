"""Run the host tools of an image build; every failure becomes an ImageBuildError."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from space.node.api import NodeError
from space.node.core.environment import child_environment

__all__ = ["ImageBuildError", "run_command"]

# How much of a failing command's output an error carries: enough for the reason
# (debootstrap prints its failing package near the end), little enough for a log line.
_TAIL_BYTES = 4096


class ImageBuildError(NodeError):
    """A guest image could not be built.

    ``command`` is the failing argv (empty when no command was at fault) and
    ``output_tail`` the last few KiB of its combined stdout and stderr.
    """

    code = "internal"

    def __init__(self, message: str, *, command: Sequence[str] = (), output_tail: str = "") -> None:
        detail = f"{message}\n--- {' '.join(command)} (output tail) ---\n{output_tail}"
        super().__init__(detail if command else message)
        self.command = tuple(command)
        self.output_tail = output_tail


def run_command(
    argv: Sequence[str],
    *,
    timeout_s: float,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    keep_bytes: int = _TAIL_BYTES,
) -> str:
    """Run ``argv`` (no shell) to completion and return the tail of its combined output.

    Output goes to a temporary file, so memory stays bounded whatever the tool prints;
    only the last ``keep_bytes`` are read back (errors carry the last 4 KiB). Raises
    ImageBuildError if the program is missing, exits non-zero or runs past
    ``timeout_s`` (its whole process group is killed first, so nothing it started
    keeps running). The program's environment is child_environment() plus ``env``,
    never the node's own (issue 18).
    """
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=child_environment(**(env or {})),
                # What these tools make (debootstrap, dpkg-deb, depmod, tar) becomes the
                # guest's files: the usual 022, not the server's 077 (issue 18).
                umask=0o022,
                start_new_session=True,
            )
        except OSError as exc:
            raise ImageBuildError(f"cannot run {argv[0]}: {exc}", command=argv) from exc
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise ImageBuildError(
                f"{argv[0]} did not finish within {timeout_s:.0f} s",
                command=argv,
                output_tail=_tail(out, _TAIL_BYTES),
            ) from None
        except BaseException:
            _kill_group(proc)
            raise
        if returncode != 0:
            raise ImageBuildError(
                f"{argv[0]} exited with status {returncode}",
                command=argv,
                output_tail=_tail(out, _TAIL_BYTES),
            )
        return _tail(out, keep_bytes)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(out: IO[bytes], keep_bytes: int) -> str:
    size = out.seek(0, os.SEEK_END)
    out.seek(max(0, size - keep_bytes))
    data: bytes = out.read()
    return data.decode(errors="replace").strip()
