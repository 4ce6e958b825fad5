"""``space control``: the control plane alone (issue 19).

The REST API over a database, with no node in the process: node agents on other hosts
register with ``space node --control-url … --token-file …``. Replicas pointed at one
PostgreSQL database serve the same API; they must share the node token and the master
keys (``--node-token-file``, ``--master-key-file`` or $SPACE_MASTER_KEY). It runs no
VM, so it needs no root and starts no root broker.
"""

from __future__ import annotations

from pathlib import Path

import click

from space.cli._common import ProgressPrinter
from space.cli._server import (
    DATA_DIR_OPTION,
    DATABASE_OPTION,
    _owner_only,
    _run_until_signal,
    _split_listen,
    _tls_files,
    api_options,
    egress_bounds_options,
    open_database,
    server_errors,
)

__all__ = ["control"]


@click.command()
@DATA_DIR_OPTION
@DATABASE_OPTION
@click.option(
    "--listen", default="127.0.0.1:8080", show_default=True,
    help="HOST:PORT to serve the API on (0.0.0.0:8080 for every address).",
)  # fmt: skip
@click.option(
    "--node-token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="The token node agents register with (made if missing; every replica needs the"
    " same) [default: DATA_DIR/node-token].",
)  # fmt: skip
@click.option(
    "--master-key-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="The master keys secrets are sealed under (made if missing; every replica needs"
    " the same) [default: DATA_DIR/master.key; unused with $SPACE_MASTER_KEY].",
)  # fmt: skip
@api_options
@egress_bounds_options
def control(
    data_dir: Path,
    database_url: str,
    listen: str,
    node_token_file: Path | None,
    master_key_file: Path | None,
    reaper_interval: float,
    reconcile_interval: float,
    reconcile_grace: float,
    node_heartbeat: float,
    node_lease: float,
    node_ca_file: Path | None,
    sandbox_domain: str,
    tls_cert: Path | None,
    tls_key: Path | None,
    egress_operator_ranges: tuple[str, ...],
    egress_allow_wide_any_port: bool,
) -> None:
    """Run the control plane alone: the API, for node agents that register with
    `space node --control-url`."""
    host, port = _split_listen(listen)
    with server_errors():
        from space.control.secrets import load_keyring
        from space.control.server import run_control_plane
        from space.control.settings import ControlSettings
        from space.control.store.db import database_url as parse_url
        from space.control.store.db import shown

        tls = _tls_files(tls_cert, tls_key)
        settings = ControlSettings(
            data_dir=data_dir,
            database_url=database_url,
            node_token_path=node_token_file,
            master_key_file=master_key_file,
            reaper_interval_s=reaper_interval,
            reconcile_interval_s=reconcile_interval,
            reconcile_grace_s=reconcile_grace,
            node_heartbeat_s=node_heartbeat,
            node_lease_s=node_lease,
            egress_operator_ranges=egress_operator_ranges,
            egress_allow_wide_any_port=egress_allow_wide_any_port,
            node_ca_file=node_ca_file,
            sandbox_domain=sandbox_domain,
        )
        _owner_only(data_dir)  # the options are known good: before the first write
        open_database(settings)
        load_keyring(settings, create=True)
    progress = ProgressPrinter()

    async def run() -> None:
        scheme = "http" if tls is None else "https"
        where = shown(parse_url(settings.database_url))
        progress(f"control plane on {scheme}://{host}:{port}, database {where}")
        token = settings.token_file
        progress(f"nodes register with: space node --control-url URL --token-file {token}")
        await run_control_plane(settings, None, host=host, port=port, tls=tls)

    _run_until_signal(run())
