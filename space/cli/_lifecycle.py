"""Lifecycle commands: hibernate, snapshot (create, ls, rm), restore, fork, timeouts.

``space resume`` (in _sandboxes.py) wakes a hibernated sandbox as well as a paused one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime

import click
from click.core import ParameterSource

from space.cli._common import (
    ProgressPrinter,
    api_options,
    connected,
    connection,
    echo_table,
    reports_errors,
)
from space.limits import MAX_FORK_CHILDREN
from space.sdk import Sandbox, SnapshotInfo

__all__ = ["fork", "hibernate", "restore", "snapshot", "snapshot_forest", "timeouts"]

#: The most children one ``space fork`` asks for (the API's limit, issue 3).
_SIZE_UNITS = ("KiB", "MiB", "GiB", "TiB")


@click.command()
@click.argument("sandbox_ids", nargs=-1, required=True)
@api_options
@reports_errors
def hibernate(sandbox_ids: tuple[str, ...], api_url: str | None, api_key: str | None) -> None:
    """Hibernate sandboxes (memory saved to disk, VM stopped; resume, exec or cp wake them)."""
    for sandbox_id in sandbox_ids:
        with connected(sandbox_id, api_url, api_key) as sandbox:
            click.echo(f"{sandbox_id}  {sandbox.hibernate().state}")


@click.command()
@click.argument("sandbox_id")
@click.argument("snapshot_id")
@api_options
@reports_errors
def restore(sandbox_id: str, snapshot_id: str, api_url: str | None, api_key: str | None) -> None:
    """Roll a sandbox back in place to one of its snapshots (disk, memory, processes)."""
    with connected(sandbox_id, api_url, api_key) as sandbox:
        info = sandbox.restore(snapshot_id)
    click.echo(f"{sandbox_id}  {info.state}  {info.head_snapshot or snapshot_id}")


@click.command()
@click.argument("sandbox_id")
@click.option(
    "-n", "count", default=1, show_default=True, type=click.IntRange(1, MAX_FORK_CHILDREN)
)
@api_options
@reports_errors
def fork(sandbox_id: str, count: int, api_url: str | None, api_key: str | None) -> None:
    """Copy a running sandbox N times (disk, memory, processes); print the children's ids."""
    with connected(sandbox_id, api_url, api_key) as sandbox:
        children = sandbox.fork(count)
    for child in children:
        child.close()
        click.echo(child.sandbox_id)


def _seconds_or_none(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A whole number of seconds (1 or more), or ``none`` for no limit (None)."""
    if value is None:
        return None  # not given (the command tells this from "none")
    text = value.strip().lower()
    if text == "none":
        return None
    # isascii: str.isdigit also accepts digits int() refuses (superscripts).
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise click.BadParameter(f"wants whole seconds (1 or more) or 'none', got {value!r}")
    return int(text)


@click.command()
@click.argument("sandbox_id")
@click.option(
    "--idle",
    metavar="S|none",
    callback=_seconds_or_none,
    help="Hibernate after S seconds without activity; none: never.",
)
@click.option(
    "--max-lifetime",
    metavar="S|none",
    callback=_seconds_or_none,
    help="Delete S seconds after its creation; none: never.",
)
@api_options
@reports_errors
def timeouts(
    sandbox_id: str,
    idle: int | None,
    max_lifetime: int | None,
    api_url: str | None,
    api_key: str | None,
) -> None:
    """Show a sandbox's idle and lifetime limits; change those given (none: no limit)."""
    ctx = click.get_current_context()
    options = {"idle_timeout_s": ("idle", idle), "max_lifetime_s": ("max_lifetime", max_lifetime)}
    changes = {
        argument: value
        for argument, (option, value) in options.items()
        if ctx.get_parameter_source(option) is not ParameterSource.DEFAULT
    }
    with connected(sandbox_id, api_url, api_key) as sandbox:
        info = sandbox.set_timeouts(**changes) if changes else sandbox.get_info()
    idle_s, max_s = (_limit(info.idle_timeout_s), _limit(info.max_lifetime_s))
    click.echo(f"{sandbox_id}  idle_timeout_s={idle_s}  max_lifetime_s={max_s}")


def _limit(seconds: int | None) -> str:
    return "none" if seconds is None else str(seconds)


@click.group()
def snapshot() -> None:
    """Manage snapshots (restorable copies of a sandbox's disk and memory)."""


@snapshot.command(name="create")
@click.argument("sandbox_id")
@click.argument("name")
@api_options
@reports_errors
def snapshot_create(sandbox_id: str, name: str, api_url: str | None, api_key: str | None) -> None:
    """Snapshot sandbox SANDBOX_ID as NAME and print the snapshot's id."""
    progress = ProgressPrinter()
    progress(f"snapshotting sandbox {sandbox_id} as {name!r}")
    with connected(sandbox_id, api_url, api_key) as sandbox:
        taken = sandbox.snapshot(name)
    progress(f"snapshot {taken.snapshot_id} taken ({_size(taken.memory_bytes)} of memory)")
    click.echo(taken.snapshot_id)


@snapshot.command(name="ls")
@click.option("--sandbox", "sandbox_id", default=None, help="Only this sandbox's snapshots.")
@api_options
@reports_errors
def snapshot_ls(sandbox_id: str | None, api_url: str | None, api_key: str | None) -> None:
    """List snapshots as a tree: each under the snapshot it was taken after."""
    listed = Sandbox.list_snapshots(sandbox_id=sandbox_id, **connection(api_url, api_key))
    rows = [_snapshot_row(depth, snap) for depth, snap in snapshot_forest(listed)]
    echo_table(("ID", "NAME", "CREATED", "MEMORY", "EXCLUSIVE"), rows)


@snapshot.command(name="rm")
@click.argument("snapshot_ids", nargs=-1, required=True)
@api_options
@reports_errors
def snapshot_rm(snapshot_ids: tuple[str, ...], api_url: str | None, api_key: str | None) -> None:
    """Delete snapshots (idempotent); their children move up to their parent."""
    for snapshot_id in snapshot_ids:
        Sandbox.delete_snapshot(snapshot_id, **connection(api_url, api_key))
        click.echo(snapshot_id)


def snapshot_forest(snapshots: Sequence[SnapshotInfo]) -> list[tuple[int, SnapshotInfo]]:
    """``(depth, snapshot)`` in tree order, each snapshot followed by its descendants.

    Roots are the snapshots whose parent is not listed; siblings go oldest first. Each
    snapshot appears once, even if a malformed answer puts it in a parent cycle (the
    cycle is then cut at its oldest member). Iterative, so a long chain cannot hit
    Python's recursion limit.
    """
    listed = {snap.snapshot_id for snap in snapshots}
    children: defaultdict[str | None, list[SnapshotInfo]] = defaultdict(list)
    for snap in snapshots:
        parent = snap.parent_id if snap.parent_id in listed else None
        children[parent].append(snap)
    order: list[tuple[int, SnapshotInfo]] = []
    seen: set[str] = set()
    starts = sorted(children[None], key=_age) + sorted(snapshots, key=_age)
    for start in starts:
        stack = [(0, start)]
        while stack:
            depth, snap = stack.pop()
            if snap.snapshot_id in seen:
                continue
            seen.add(snap.snapshot_id)
            order.append((depth, snap))
            below = sorted(children[snap.snapshot_id], key=_age, reverse=True)
            stack.extend((depth + 1, child) for child in below)
    return order


def _age(snap: SnapshotInfo) -> tuple[datetime, str]:
    return (snap.created_at, snap.snapshot_id)


def _snapshot_row(depth: int, snap: SnapshotInfo) -> tuple[str, ...]:
    return (
        "  " * depth + snap.snapshot_id,
        snap.name,
        snap.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        _size(snap.memory_bytes),
        _size(snap.exclusive_bytes),
    )


def _size(n_bytes: int | None) -> str:
    """Bytes for a person: ``512 B``, ``1.5 KiB``, ``256.0 MiB``; ``-`` when unknown."""
    if n_bytes is None:
        return "-"
    if n_bytes < 1024:
        return f"{n_bytes} B"
    value = float(n_bytes)
    for unit in _SIZE_UNITS:
        value /= 1024
        if value < 1024 or unit == _SIZE_UNITS[-1]:
            break
    return f"{value:.1f} {unit}"
