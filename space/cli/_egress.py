"""``space egress``: a sandbox's network policy (show, set) and its audit log.

Rules are written as for ``space create --allow``: ``pypi.org``, ``*.github.com:443``,
``203.0.113.0/24:5432``, ``[2001:db8::/32]:443`` (ports default to 80 and 443).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from space.cli._common import api_options, connected, echo_table, fail, reports_errors
from space.limits import MAX_EGRESS_LOG_EVENTS
from space.sdk import EgressEvent, allow
from space.sdk.errors import InvalidArgument

__all__ = ["ALLOW_HELP", "egress", "policy_of"]

#: The help of every ``--allow`` option.
ALLOW_HELP = (
    "Allow a destination: DOMAIN[:PORTS] or NETWORK[:PORTS] ('*' is one label, IPv6 in "
    "brackets, ports default to 80,443). Repeatable."
)


def policy_of(rules: Sequence[str]) -> dict[str, Any]:
    """The policy allowing ``rules`` (none: no network); exits 2 on a malformed rule."""
    try:
        return allow(*rules)
    except InvalidArgument as exc:
        fail(f"--allow: {exc.message}", 2)


def _echo_policy(policy: dict[str, Any]) -> None:
    click.echo(json.dumps(policy, indent=2))


@click.group()
def egress() -> None:
    """Show or set a sandbox's network policy, and read its egress log."""


@egress.command(name="show")
@click.argument("sandbox_id")
@api_options
@reports_errors
def egress_show(sandbox_id: str, api_url: str | None, api_key: str | None) -> None:
    """Print SANDBOX_ID's egress policy as JSON ({"allow": []} is no network)."""
    with connected(sandbox_id, api_url, api_key) as sandbox:
        _echo_policy(sandbox.network.get_policy())


@egress.command(name="set")
@click.argument("sandbox_id")
@click.option("--allow", "rules", multiple=True, metavar="RULE", help=ALLOW_HELP)
@api_options
@reports_errors
def egress_set(
    sandbox_id: str, rules: tuple[str, ...], api_url: str | None, api_key: str | None
) -> None:
    """Replace SANDBOX_ID's policy with the --allow rules; none closes all network.

    Prints the policy as the server stored it. Asks nothing: scripts can call it.
    """
    policy = policy_of(rules)
    with connected(sandbox_id, api_url, api_key) as sandbox:
        _echo_policy(sandbox.network.set_policy(policy))


@egress.command(name="log")
@click.argument("sandbox_id")
@click.option(
    "--limit", default=100, show_default=True, type=click.IntRange(1, MAX_EGRESS_LOG_EVENTS)
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
@api_options
@reports_errors
def egress_log(
    sandbox_id: str, limit: int, as_json: bool, api_url: str | None, api_key: str | None
) -> None:
    """Print SANDBOX_ID's latest egress decisions, oldest first."""
    with connected(sandbox_id, api_url, api_key) as sandbox:
        events = sandbox.network.log(limit)
    if as_json:
        click.echo(json.dumps([_as_json(event) for event in events]))
    else:
        header = ("TIME", "DECISION", "PROTO", "HOST", "ADDRESS:PORT", "BYTES OUT/IN", "SECRETS")
        echo_table((*header, "REASON"), [_row(event) for event in events])
    if events.dropped:
        # On stderr: --json's stdout stays the list it always was.
        click.echo(f"{events.dropped} events dropped over the audit's budget", err=True)


def _row(event: EgressEvent) -> tuple[str, ...]:
    return (
        event.time.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
        event.decision,
        event.protocol,
        event.host or "-",
        _endpoint(event),
        f"{event.bytes_out}/{event.bytes_in}",
        ",".join(event.secrets) or "-",
        event.reason,
    )


def _endpoint(event: EgressEvent) -> str:
    if event.address is None:
        return "-" if event.port is None else f"-:{event.port}"
    # An IPv6 address is bracketed so that its port stays readable.
    host = f"[{event.address}]" if ":" in event.address else event.address
    return host if event.port is None else f"{host}:{event.port}"


def _as_json(event: EgressEvent) -> dict[str, Any]:
    return {
        "time": event.time.isoformat(),
        "decision": event.decision,
        "protocol": event.protocol,
        "host": event.host,
        "address": event.address,
        "port": event.port,
        "bytes_out": event.bytes_out,
        "bytes_in": event.bytes_in,
        "secrets": list(event.secrets),
        "reason": event.reason,
    }
