"""``space ports``: who may reach servers listening in a sandbox, and where.

``space ports ID --enable PORT`` lets holders of the sandbox's traffic token reach it
(``--public``: anyone) and prints, for ``PORT``, the URL and the header to send.
"""

from __future__ import annotations

from typing import Literal

import click

from space.cli._common import api_options, connected, reports_errors
from space.sdk import Sandbox
from space.sdk.errors import InvalidArgument

__all__ = ["ports"]


@click.command()
@click.argument("sandbox_id")
@click.argument("port", type=click.IntRange(1, 65535), required=False)
@click.option("--enable", "mode", flag_value="token", help="Reachable with its traffic token.")
@click.option("--public", "mode", flag_value="public", help="Reachable by anyone.")
@click.option("--disable", "mode", flag_value="off", help="Not reachable (the default).")
@api_options
@reports_errors
def ports(
    sandbox_id: str,
    port: int | None,
    mode: str | None,
    api_url: str | None,
    api_key: str | None,
) -> None:
    """Show or set who may reach servers listening in SANDBOX_ID; with PORT, print the
    URL of that port (https://PORT-ID.DOMAIN/) and the token header to send."""
    with connected(sandbox_id, api_url, api_key) as sandbox:
        if mode is not None:
            expose: bool | Literal["public"] = "public" if mode == "public" else mode == "token"
            info = sandbox.set_ports(expose)
        else:
            info = sandbox.get_info()
        state = "public" if info.ports.public else "token" if info.ports.enabled else "off"
        click.echo(f"ports: {state}")
        if port is not None:
            _echo_port(sandbox, port)


def _echo_port(sandbox: Sandbox, port: int) -> None:
    try:
        click.echo(f"url: https://{sandbox.get_host(port)}/")
    except InvalidArgument:
        click.echo(
            f"url: the API's own address, with headers E2b-Sandbox-Id: {sandbox.sandbox_id} "
            f"and E2b-Sandbox-Port: {port}"
        )
    if sandbox.traffic_token is not None:
        click.echo(f"header: X-Space-Traffic-Token: {sandbox.traffic_token}")
