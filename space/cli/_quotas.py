"""``space quota``: a tenant's own limits (set) and its limits and use (show).

Server commands: they work on the control plane's database in ``--data-dir``, as
``space keys`` does, so only the operator runs them; a tenant sees its own quotas with
``GET /v1/quota``. The options come from the one table of quotas, space.limits.QUOTAS.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from space.cli._common import echo_table, fail
from space.cli._server import DATA_DIR_OPTION, DATABASE_OPTION, server_errors
from space.limits import QUOTAS

if TYPE_CHECKING:
    from space.control.quota_admin import QuotaLine

__all__ = ["quota"]

#: The value that puts a quota back to the default.
DEFAULT = "default"


class _Limit(click.ParamType[int | str, str]):
    """A whole number >= 0, or ``default`` (kept as that string)."""

    name = "N|default"

    def convert(
        self, value: str, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | str:
        if value == DEFAULT:
            return DEFAULT
        try:
            limit = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither a whole number nor {DEFAULT!r}", param, ctx)
        if limit < 0:
            self.fail(f"{limit} is negative", param, ctx)
        return limit


def _quota_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """One ``--<quota>`` option per quota, passed as ``<quota name>=value``."""
    for quota in reversed(QUOTAS):
        command = click.option(
            quota.option,
            quota.name,
            type=_Limit(),
            default=None,
            help=f"Most {quota.counts} [{quota.unit}]; '{DEFAULT}': the default again.",
        )(command)
    return command


@click.group()
def quota() -> None:
    """Manage a tenant's quotas (server command: works on --data-dir)."""


@quota.command(name="set")
@click.option("--tenant", required=True, help="The tenant whose limits change.")
@_quota_options
@click.option("--reset", is_flag=True, help="Put every quota not given back to the default.")
@DATA_DIR_OPTION
@DATABASE_OPTION
def quota_set(
    tenant: str, reset: bool, data_dir: Path, database_url: str, **limits: int | str | None
) -> None:
    """Give TENANT its own limits, then show its quotas."""
    # An option not given (None) leaves its quota alone; 'default' (None below) resets it.
    given = {
        name: None if value == DEFAULT else int(value)
        for name, value in limits.items()
        if value is not None
    }
    if not given and not reset:
        fail("nothing to set: give a quota option (see --help) or --reset", 2)
    with server_errors():
        from space.control.quota_admin import set_quotas
        from space.control.settings import ControlSettings

        settings = ControlSettings(data_dir=data_dir, database_url=database_url)
        lines = set_quotas(settings, tenant, given, reset=reset)
    _show(lines)


@quota.command(name="show")
@click.option("--tenant", required=True, help="The tenant to show.")
@DATA_DIR_OPTION
@DATABASE_OPTION
def quota_show(tenant: str, data_dir: Path, database_url: str) -> None:
    """Show TENANT's limits (its own or the default) and what it uses of each.

    Templates and builds in use are known only to the running server (GET /v1/quota).
    """
    with server_errors():
        from space.control.quota_admin import show_quotas
        from space.control.settings import ControlSettings

        lines = show_quotas(ControlSettings(data_dir=data_dir, database_url=database_url), tenant)
    _show(lines)


def _show(lines: list[QuotaLine]) -> None:
    rows = [
        (
            line.quota.name,
            str(line.limit),
            "own" if line.own else DEFAULT,
            "-" if line.used is None else str(line.used),
            line.quota.unit,
        )
        for line in lines
    ]
    echo_table(("QUOTA", "LIMIT", "SET", "USED", "UNIT"), rows)
