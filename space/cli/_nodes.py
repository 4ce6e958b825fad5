"""``space node ls|drain|activate``: an operator's view of a control plane's nodes
(issue 19), with the node token, over the control plane's REST API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import httpx

from space.cli._common import fail
from space.cli._server import _check_url, _read_token

__all__ = ["NODE_COMMANDS"]

_CONTROL_URL = click.option(
    "--control-url", required=True, help="The control plane, e.g. http://ctl:8080."
)
_TOKEN_FILE = click.option(
    "--token-file", required=True, type=click.Path(dir_okay=False, path_type=Path)
)
#: Leaves what a malformed or hostile answer could make of a table readable.
_MAX_ANSWER_BYTES = 16 * 2**20


def _call(method: str, control_url: str, token_file: Path, path: str) -> Any:
    """The JSON answer of the control plane, or one ``error:`` line and exit 1."""
    url = _check_url(control_url) + path
    headers = {"Authorization": f"Bearer {_read_token(token_file)}"}
    try:
        with httpx.Client(timeout=30.0) as client:
            response = client.request(method, url, headers=headers)
    except httpx.HTTPError as exc:
        fail(f"control plane at {control_url} unreachable: {exc}")
    if len(response.content) > _MAX_ANSWER_BYTES:
        fail(f"the control plane's answer is larger than {_MAX_ANSWER_BYTES} bytes")
    try:
        body = response.json()
    except ValueError:
        fail(f"the control plane answered {response.status_code} without JSON")
    if response.status_code >= 400:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        fail(str(error.get("message") or f"HTTP {response.status_code}"))
    return body


def _line(out: dict[str, Any]) -> str:
    reported = out.get("reported") or {}
    room = reported.get("room", "-")
    sandboxes = out.get("sandboxes")
    return (
        f"{out['node_id']:<24} {out['state']:<9} {'yes' if out['reachable'] else 'no':<9} "
        f"{'-' if sandboxes is None else sandboxes:>9} {room:>5}  {out['url']}"
    )


_HEADER = f"{'NODE':<24} {'STATE':<9} {'REACHABLE':<9} {'SANDBOXES':>9} {'ROOM':>5}  URL"


def _show(nodes: list[dict[str, Any]]) -> None:
    click.echo(_HEADER)
    for out in nodes:
        click.echo(_line(out))


@click.command("ls")
@_CONTROL_URL
@_TOKEN_FILE
def ls(control_url: str, token_file: Path) -> None:
    """List the control plane's nodes: state (active, draining, lost), sandboxes, room."""
    _show(_call("GET", control_url, token_file, "/v1/nodes")["nodes"])


@click.command()
@click.argument("node_id")
@_CONTROL_URL
@_TOKEN_FILE
def drain(node_id: str, control_url: str, token_file: Path) -> None:
    """Place no more sandboxes on NODE_ID; its paused and hibernated sandboxes move to
    other nodes in the background."""
    _show([_call("POST", control_url, token_file, f"/v1/nodes/{node_id}/drain")])


@click.command()
@click.argument("node_id")
@_CONTROL_URL
@_TOKEN_FILE
def activate(node_id: str, control_url: str, token_file: Path) -> None:
    """Place sandboxes on NODE_ID again (undoes a drain)."""
    _show([_call("POST", control_url, token_file, f"/v1/nodes/{node_id}/activate")])


#: ``space node``'s commands (the group itself runs a node agent).
NODE_COMMANDS = (ls, drain, activate)
