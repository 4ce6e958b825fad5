"""The ``space`` command line.

Client commands (create, ls, rm, pause, hibernate, resume, snapshot, restore, fork,
timeouts, exec, cp, egress, ports, secret, pools, template, demo) go through the SDK; server
commands (serve, node, keys, quota, template build-base, secret rotate-master) import the node
and control plane only when they run.
Every failure is one ``error: ...`` line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import click

from space.cli._common import CliContext
from space.cli._control import control
from space.cli._demo import demo
from space.cli._egress import egress
from space.cli._lifecycle import fork, hibernate, restore, snapshot, timeouts
from space.cli._metrics import metrics
from space.cli._nodes import NODE_COMMANDS
from space.cli._pools import pools
from space.cli._ports import ports
from space.cli._quotas import quota
from space.cli._sandboxes import cp, create, exec_, ls, pause, resume, rm
from space.cli._secrets import secret
from space.cli._server import keys, node, serve
from space.cli._templates import template

__all__ = ["CliContext", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option("0.1.0", prog_name="space")
@click.pass_context
def main(ctx: click.Context) -> None:
    """SPACE: sandboxed virtual machines for agents to run code in."""
    ctx.ensure_object(CliContext)


for _command in (
    *(serve, control, node, keys, quota, template, create, ls, rm, pause, hibernate, resume),
    *(snapshot, restore, fork, timeouts, exec_, cp, egress, secret, pools, demo, metrics, ports),
):
    main.add_command(_command)
for _command in NODE_COMMANDS:
    node.add_command(_command)
