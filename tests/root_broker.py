"""A root broker for tests that drive node parts without a Node (which starts its own)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path

from space.node.network.netns import node_prefix
from space.node.privileged import RootBroker, Scope, broker_for, start_broker


@contextlib.contextmanager
def root_broker(directory: Path, *more_roots: Path) -> Iterator[RootBroker]:
    """A broker whose scope is ``directory`` (and ``more_roots``), its run root
    ``directory/run``; usable from any event loop, ended after."""
    run_root = directory / "run"
    run_root.mkdir(mode=0o700, parents=True, exist_ok=True)
    with root_broker_of(Scope(run_root, (directory, *more_roots))) as broker:
        yield broker


@contextlib.contextmanager
def root_broker_of(scope: Scope) -> Iterator[RootBroker]:
    """A broker of ``scope``, usable from any event loop, ended after."""
    broker = asyncio.run(start_broker(scope))
    try:
        yield broker
    finally:
        asyncio.run(broker.close())


def netns_name_of(broker: RootBroker) -> str:
    """A fresh namespace name the broker accepts (its node's prefix)."""
    return node_prefix(broker.scope.run_root) + secrets.token_hex(3)


def gateway_broker(egress_dir: Path) -> RootBroker:
    """The broker ``root_broker(egress_dir.parent)`` started."""
    return broker_for(egress_dir.parent / "run")
