"""Where a failed VM test's logs are: a registry of data dirs, and their bounded tails.

Fixtures that make a node or platform data dir call ``register`` (tests/integration:
``node_config``, ``started_node``, ``running_platform``); the hook in tests/conftest.py
adds, to the report of a failed ``vm`` test, the tail of every log of those dirs that
changed while the test ran: the node's per-sandbox console logs
(``<data_dir>/sandboxes/*.console.log``), a platform's ``serve.log``, the egress
gateway's log (``<data_dir>/egress/gateway.log``) and the QEMU stderr logs
(``<run_dir>/<sandbox>/qemu.log``). CI prints pytest's output, so they end
up next to the failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

__all__ = ["MAX_FILES", "TAIL_BYTES", "TAIL_LINES", "failure_sections", "register", "tail"]

#: Per log: the last lines, and at most this many bytes of them (CI output stays readable).
TAIL_LINES = 60
TAIL_BYTES = 8 << 10
#: Per failed test: the most recently changed logs only.
MAX_FILES = 12

#: data dir -> run dir (None: the node's default for that data dir), in registration order.
_REGISTERED: dict[Path, Path | None] = {}


def register(data_dir: Path, run_dir: Path | None = None) -> None:
    """Name a data dir whose logs a failed VM test should show; idempotent (a run dir
    given replaces the default)."""
    if run_dir is not None or data_dir not in _REGISTERED:
        _REGISTERED[Path(data_dir)] = run_dir


def registered() -> list[tuple[Path, Path | None]]:
    return list(_REGISTERED.items())


def tail(path: Path, lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> str:
    """The last ``lines`` lines of ``path``, reading no more than its last ``max_bytes``.

    An unreadable file gives a one-line note instead (the VM may have removed it).
    """
    try:
        with path.open("rb") as file:
            size = file.seek(0, 2)
            file.seek(max(0, size - max_bytes))
            data = file.read(max_bytes)
    except OSError as exc:
        return f"(unreadable: {exc})"
    text = data.decode("utf-8", "replace")
    if size > max_bytes:
        text = text.partition("\n")[2]  # the first line read is probably cut
    return "\n".join(text.splitlines()[-lines:])


def failure_sections(
    since: float, dirs: list[tuple[Path, Path | None]] | None = None
) -> list[tuple[str, str]]:
    """(title, tail) of each registered log changed at or after ``since`` (epoch seconds),
    newest first, at most MAX_FILES."""
    changed = []
    for path in _logs(registered() if dirs is None else dirs):
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        if mtime >= since:
            changed.append((mtime, path))
    changed.sort(reverse=True)
    return [(f"log {path}", tail(path)) for _, path in changed[:MAX_FILES]]


def _logs(dirs: list[tuple[Path, Path | None]]) -> Iterator[Path]:
    for data_dir, run_dir in dirs:
        yield data_dir / "serve.log"
        yield data_dir / "egress" / "gateway.log"
        yield from sorted(data_dir.glob("sandboxes/*.console.log"))
        yield from sorted((run_dir or _default_run_dir(data_dir)).glob("*/qemu.log"))


def _default_run_dir(data_dir: Path) -> Path:
    # Imported here: only a failed VM test needs it, and tests/ stays free of node
    # imports at collection time.
    from space.node.core.config import NodeConfig

    return NodeConfig(data_dir=data_dir).effective_run_dir
