"""What every ``space`` command shares: connection options, error lines, progress."""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, ParamSpec, TypeVar

import click
import httpx

from space.sdk import Sandbox
from space.sdk.errors import SpaceError

__all__ = [
    "CliContext",
    "ProgressPrinter",
    "api_options",
    "connected",
    "connection",
    "echo_table",
    "fail",
    "reports_errors",
]

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class CliContext:
    """State shared by the commands of one invocation.

    ``transport`` replaces the network for every SDK call (tests inject the app).
    """

    transport: httpx.AsyncBaseTransport | None = None


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` as one line on stderr and exit with ``code``."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def reports_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Turn SpaceError into one ``error: ...`` line and exit code 1; Ctrl-C into 130."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except SpaceError as exc:
            fail(f"{exc.code}: {exc}")
        except KeyboardInterrupt:
            fail("interrupted", 130)

    return run


def api_options(command: Callable[P, R]) -> Callable[P, R]:
    """Add ``--api-url`` and ``--api-key`` (defaults: SPACE_API_URL / SPACE_API_KEY)."""
    command = click.option("--api-key", default=None, help="API key (default: $SPACE_API_KEY).")(
        command
    )
    return click.option(
        "--api-url", default=None, help="API base URL (default: $SPACE_API_URL or :8080)."
    )(command)


def connection(api_url: str | None, api_key: str | None) -> dict[str, Any]:
    """Keyword arguments that point an SDK entry point at the chosen API."""
    ctx = click.get_current_context().find_object(CliContext) or CliContext()
    return {"api_url": api_url, "api_key": api_key, "_transport": ctx.transport}


@contextlib.contextmanager
def connected(sandbox_id: str, api_url: str | None, api_key: str | None) -> Iterator[Sandbox]:
    """A connection to a sandbox for one block; closed (the sandbox kept) afterwards."""
    sandbox = Sandbox.connect(sandbox_id, **connection(api_url, api_key))
    try:
        yield sandbox
    finally:
        sandbox.close()


def echo_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print ``header`` and ``rows`` as left-aligned columns two spaces apart."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    for line in (header, *rows):
        click.echo("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


class ProgressPrinter:
    """Progress lines on stderr, each stamped with the seconds since it was made."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._start = clock()

    def __call__(self, message: str) -> None:
        click.echo(f"[{self._clock() - self._start:7.1f}s] {message}", err=True)
