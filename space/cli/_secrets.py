"""``space secret``: the tenant's secrets (set, ls, rm) and master key rotation.

A value is read from stdin (hidden prompt on a terminal) or ``--value-file``, never from
the command line, which other users of the machine can read (``ps``). ``rotate-master``
is a server command: it works on the control plane's database directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from space.cli._common import api_options, connection, echo_table, fail, reports_errors
from space.cli._server import DATA_DIR_OPTION, DATABASE_OPTION, server_errors
from space.sdk import SecretInfo, Secrets

__all__ = ["MAX_VALUE_BYTES", "secret"]

#: Longest value the API takes (space.node.api.secret_grants.MAX_VALUE_BYTES).
MAX_VALUE_BYTES = 16 * 1024


@click.group()
def secret() -> None:
    """Store secrets that sandboxes use without seeing them."""


@secret.command(name="set")
@click.argument("name")
@click.option(
    "--host",
    "hosts",
    multiple=True,
    required=True,
    metavar="PATTERN",
    help="A host the value may be sent to (api.example.com, *.example.com). Repeatable.",
)
@click.option(
    "--env",
    default=None,
    metavar="VAR",
    help="The variable holding the placeholder in sandboxes [default: NAME].",
)
@click.option("--header", default=None, help="Set this header on every request to the hosts.")
@click.option(
    "--format",
    "format_",
    default=None,
    metavar="TEXT",
    help="With --header: the header's value, {value} replaced [default: {value}].",
)
@click.option(
    "--value-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Read the value from this file [default: stdin].",
)
@api_options
@reports_errors
def secret_set(
    name: str,
    hosts: tuple[str, ...],
    env: str | None,
    header: str | None,
    format_: str | None,
    value_file: Path | None,
    api_url: str | None,
    api_key: str | None,
) -> None:
    """Create or replace secret NAME, its value read from stdin or --value-file.

    Sandboxes made with `space create --secret NAME` see a placeholder in $VAR; their egress
    gateway sends the value in its place only to the --host patterns (with --header,
    it sets that header instead). One trailing newline of the value is dropped.
    """  # fmt: skip
    if format_ is not None and header is None:
        fail("--format goes with --header", 2)
    value = _read_value(value_file)
    info = Secrets.set(
        name,
        value,
        list(hosts),
        env=env,
        injection="placeholder" if header is None else "header",
        header=header,
        format=format_ or "{value}",
        **connection(api_url, api_key),
    )
    click.echo(f"{info.name}  env {info.env}  hosts {','.join(info.hosts)}")


def _read_value(path: Path | None) -> str:
    """The value from ``path`` or stdin, one trailing newline dropped; exits 2 if it is
    unreadable, empty, too long or not UTF-8 (the message never holds the value)."""
    if path is None and sys.stdin.isatty():
        return str(click.prompt("value", hide_input=True, err=True))
    try:
        if path is None:
            data = sys.stdin.buffer.read(MAX_VALUE_BYTES + 2)
        else:
            with path.open("rb") as file:
                data = file.read(MAX_VALUE_BYTES + 2)
    except OSError as exc:
        fail(f"cannot read the value: {exc.strerror or exc}", 2)
    data = data.removesuffix(b"\n").removesuffix(b"\r")
    if len(data) > MAX_VALUE_BYTES:
        fail(f"the value is longer than {MAX_VALUE_BYTES} bytes", 2)
    try:
        value = data.decode()
    except UnicodeDecodeError:
        fail("the value is not UTF-8", 2)
    if not value:
        fail("the value is empty", 2)
    return value


@secret.command(name="ls")
@api_options
@reports_errors
def secret_ls(api_url: str | None, api_key: str | None) -> None:
    """List your secrets (names and where they go; never values)."""
    rows = [_row(info) for info in Secrets.list(**connection(api_url, api_key))]
    echo_table(("NAME", "ENV", "HOSTS", "INJECTION", "UPDATED"), rows)


def _row(info: SecretInfo) -> tuple[str, ...]:
    injection = info.injection if info.header is None else f"{info.header}: {info.format}"
    return (
        info.name,
        info.env,
        ",".join(info.hosts),
        injection,
        info.updated_at.strftime("%Y-%m-%d %H:%M:%S"),
    )


@secret.command(name="rm")
@click.argument("names", nargs=-1, required=True)
@api_options
@reports_errors
def secret_rm(names: tuple[str, ...], api_url: str | None, api_key: str | None) -> None:
    """Delete secrets (idempotent); sandboxes using them stop getting them at once."""
    for name in names:
        Secrets.delete(name, **connection(api_url, api_key))
        click.echo(name)


@secret.command(name="rotate-master")
@DATA_DIR_OPTION
@DATABASE_OPTION
@click.option(
    "--master-key-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="[default: DATA_DIR/master.key; unused with $SPACE_MASTER_KEY]",
)
def secret_rotate_master(data_dir: Path, database_url: str, master_key_file: Path | None) -> None:
    """Re-wrap every secret's data key under the current master key (server command).

    Put the new key first (in the key file, or $SPACE_MASTER_KEY with the old ones in
    $SPACE_OLD_MASTER_KEYS), run this, then drop the old keys. Values are never
    decrypted to disk. Safe while the server runs.
    """  # fmt: skip
    with server_errors():
        from space.control.secrets import rotate_master
        from space.control.settings import ControlSettings

        settings = ControlSettings(
            data_dir=data_dir, database_url=database_url, master_key_file=master_key_file
        )
        count, key_id = rotate_master(settings)
    click.echo(f"re-wrapped {count} data keys under master key {key_id}")
