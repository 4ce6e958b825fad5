"""Client commands: create, ls, rm, pause, resume, exec, cp (all through the SDK).

The snapshot, hibernate, restore, fork and timeouts commands are in _lifecycle.py.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path, PurePosixPath
from typing import Any

import click

from space.cli._common import (
    ProgressPrinter,
    api_options,
    connected,
    connection,
    echo_table,
    fail,
    reports_errors,
)
from space.cli._egress import ALLOW_HELP, policy_of
from space.cli._terminal import run_piped, run_terminal, stdin_reader, stdout_writer
from space.sdk import CommandResult, Sandbox, SandboxInfo

__all__ = ["cp", "create", "exec_", "ls", "pause", "resume", "rm"]

#: Exit status of ``space exec`` when the command hit its timeout (as timeout(1) does).
EXIT_TIMED_OUT = 124
#: ``ID:/path`` names a path in a sandbox; anything else is local (``./a:b`` stays local).
_REMOTE = re.compile(r"^(?P<id>[A-Za-z0-9][A-Za-z0-9_-]*):(?P<path>.+)$")


@click.command()
@click.option("--template", default=None, help="[default: base]")
@click.option("--cpus", default=None, type=int, help="[default: the template's; base: 1]")
@click.option("--memory-mib", default=None, type=int, help="[default: the template's; base: 256]")
@click.option("--disk-mib", default=None, type=int, help="[default: the template's; base: 2048]")
@click.option("--timeout-s", default=300, show_default=True, type=int, help="Lifetime; 0: none.")
@click.option(
    "--idle-timeout",
    "idle_timeout_s",
    default=None,
    type=click.IntRange(min=1),
    metavar="S",
    help="Hibernate after S seconds without activity [default: never].",
)
@click.option(
    "--from-snapshot",
    default=None,
    metavar="SNAP_ID",
    help="Start from a snapshot (its template and sizes, memory and processes).",
)
@click.option("--allow", "rules", multiple=True, metavar="RULE", help=ALLOW_HELP)
@click.option(
    "--secret",
    "secrets",
    multiple=True,
    metavar="NAME",
    help="Let it use this secret (space secret set): a placeholder in its env. Repeatable.",
)
@api_options
@reports_errors
def create(
    template: str | None,
    cpus: int | None,
    memory_mib: int | None,
    disk_mib: int | None,
    timeout_s: int,
    idle_timeout_s: int | None,
    from_snapshot: str | None,
    rules: tuple[str, ...],
    secrets: tuple[str, ...],
    api_url: str | None,
    api_key: str | None,
) -> None:
    """Create a sandbox and print its id.

    Without --allow it has no network (from a snapshot: the policy of the snapshot's
    sandbox); ``space egress set`` changes that later.
    """
    policy = policy_of(rules) if rules else None
    if from_snapshot is not None:
        sizes = {"--template": template, "--cpus": cpus, "--memory-mib": memory_mib}
        _refuse_sizes({**sizes, "--disk-mib": disk_mib})
    progress = ProgressPrinter()
    source = f"snapshot {from_snapshot!r}" if from_snapshot else f"template {template or 'base'!r}"
    progress(f"creating a sandbox from {source}")
    sandbox = Sandbox.create(
        template,
        cpus=cpus,
        memory_mib=memory_mib,
        disk_mib=disk_mib,
        timeout_s=timeout_s or None,
        idle_timeout_s=idle_timeout_s,
        from_snapshot=from_snapshot,
        egress=policy,
        secrets=list(secrets) if secrets else None,
        **connection(api_url, api_key),
    )
    progress(f"sandbox {sandbox.sandbox_id} is running")
    sandbox.close()
    click.echo(sandbox.sandbox_id)


def _refuse_sizes(sizes: dict[str, object]) -> None:
    """Exit 2 if any of ``sizes`` was given: a snapshot fixes them."""
    given = [flag for flag, value in sizes.items() if value is not None]
    if given:
        fail(f"--from-snapshot takes the template and sizes from the snapshot: drop {given[0]}", 2)


@click.command()
@api_options
@reports_errors
def ls(api_url: str | None, api_key: str | None) -> None:
    """List your sandboxes."""
    rows = [_row(info) for info in Sandbox.list(**connection(api_url, api_key))]
    echo_table(("ID", "TEMPLATE", "STATE", "CPUS", "MEMORY_MIB", "CREATED", "EXPIRES"), rows)


def _row(info: SandboxInfo) -> tuple[str, ...]:
    def when(value: object) -> str:
        return value.strftime("%Y-%m-%d %H:%M:%S") if hasattr(value, "strftime") else "-"

    return (
        info.sandbox_id,
        info.template,
        info.state,
        str(info.cpus),
        str(info.memory_mib),
        when(info.created_at),
        when(info.expires_at),
    )


@click.command()
@click.argument("sandbox_ids", nargs=-1, required=True)
@api_options
@reports_errors
def rm(sandbox_ids: tuple[str, ...], api_url: str | None, api_key: str | None) -> None:
    """Delete sandboxes."""
    for sandbox_id in sandbox_ids:
        Sandbox.connect(sandbox_id, **connection(api_url, api_key)).kill()
        click.echo(sandbox_id)


@click.command()
@click.argument("sandbox_ids", nargs=-1, required=True)
@api_options
@reports_errors
def pause(sandbox_ids: tuple[str, ...], api_url: str | None, api_key: str | None) -> None:
    """Pause sandboxes (vCPUs stopped, memory kept; exec or cp resumes them)."""
    for sandbox_id in sandbox_ids:
        with connected(sandbox_id, api_url, api_key) as sandbox:
            click.echo(f"{sandbox_id}  {sandbox.pause().state}")


@click.command()
@click.argument("sandbox_ids", nargs=-1, required=True)
@api_options
@reports_errors
def resume(sandbox_ids: tuple[str, ...], api_url: str | None, api_key: str | None) -> None:
    """Resume paused sandboxes, or wake hibernated ones."""
    for sandbox_id in sandbox_ids:
        with connected(sandbox_id, api_url, api_key) as sandbox:
            click.echo(f"{sandbox_id}  {sandbox.resume().state}")


@click.command(name="exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--env", "-e", multiple=True, help="KEY=VALUE, repeatable.")
@click.option("--cwd", default=None)
@click.option("--user", default=None)
@click.option("--timeout-s", default=300.0, show_default=True, type=float, help="0: none.")
@click.option(
    "--interactive", "-i", is_flag=True, help="Stream our stdin to the command as it comes."
)
@click.option(
    "--tty",
    "-t",
    is_flag=True,
    help="With -i: a terminal session (PTY, raw keys, Ctrl-C, resize), e.g. -it ID -- bash.",
)
@api_options
@reports_errors
def exec_(
    sandbox_id: str,
    command: tuple[str, ...],
    env: tuple[str, ...],
    cwd: str | None,
    user: str | None,
    timeout_s: float,
    interactive: bool,
    tty: bool,
    api_url: str | None,
    api_key: str | None,
) -> None:
    """Run a command in a sandbox: space exec ID -- CMD [ARGS...].

    One word runs through the shell (``space exec ID -- 'ls | wc -l'``); several run as
    an argv, without a shell. Output streams live; the exit status is the command's
    (128+N for signal N, 124 when it timed out). ``-it`` runs it on a terminal: keys go
    as typed (Ctrl-C included), the window size follows ours, and the command is killed
    if this client goes away.
    """
    if tty and not (interactive and _stdin_is_a_terminal()):
        fail("-t wants -i and a terminal on stdin", 2)
    with connected(sandbox_id, api_url, api_key) as sandbox:
        if tty:
            result = run_terminal(
                sandbox,
                command[0] if len(command) == 1 else list(command),
                env=_parse_env(env),
                cwd=cwd,
                user=user,
                timeout_s=timeout_s or None,
                stdin_fd=sys.stdin.fileno(),
                write=stdout_writer(),
            )
            sys.exit(exit_status(result))
        options: dict[str, Any] = {
            "env": _parse_env(env),
            "cwd": cwd,
            "user": user,
            "timeout_s": timeout_s or None,
            "on_stdout": lambda text: click.echo(text, nl=False),
            "on_stderr": lambda text: click.echo(text, nl=False, err=True),
        }
        argv = command[0] if len(command) == 1 else list(command)
        if interactive:
            result = run_piped(sandbox, argv, read=stdin_reader(sys.stdin.buffer), **options)
        else:
            result = sandbox.commands.run(argv, **options)
    sys.exit(exit_status(result))


def exit_status(result: CommandResult) -> int:
    """The shell's convention: the exit code, 128+signal, 124 for a timeout."""
    if result.timed_out:
        return EXIT_TIMED_OUT
    if result.signal is not None:
        return 128 + result.signal
    return result.exit_code if result.exit_code is not None else 1


def _parse_env(pairs: tuple[str, ...]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            fail(f"--env wants KEY=VALUE, got {pair!r}", 2)
        env[key] = value
    return env


def _stdin_is_a_terminal() -> bool:
    try:
        return os.isatty(sys.stdin.fileno())
    except (OSError, ValueError):  # no file descriptor at all (a test's buffer)
        return False


@click.command()
@click.argument("src")
@click.argument("dst")
@api_options
@reports_errors
def cp(src: str, dst: str, api_url: str | None, api_key: str | None) -> None:
    """Copy a file into or out of a sandbox; a sandbox path is written ID:/path."""
    source, target = _REMOTE.match(src), _REMOTE.match(dst)
    if (source is None) == (target is None):
        fail("exactly one of SRC and DST must be a sandbox path (ID:/path)", 2)
    started = time.monotonic()
    if target is not None:
        local = Path(src)
        remote = target["path"]
        if remote.endswith("/"):
            remote += local.name
        with connected(target["id"], api_url, api_key) as sandbox:
            size = sandbox.files.upload_from(local, remote).size
    elif source is not None:
        local = Path(dst)
        if local.is_dir():
            local /= PurePosixPath(source["path"]).name
        with connected(source["id"], api_url, api_key) as sandbox:
            size = sandbox.files.download_to(source["path"], local)
    click.echo(f"copied {size} bytes in {time.monotonic() - started:.2f} s", err=True)
