"""Fixtures the unit tests share: the async backend and the real API over a FakeNode."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from space.node.network.gateway_client import running_gateways
from tests.root_broker import root_broker
from tests.unit import fakes
from tests.unit._live_api import LiveApi


@pytest.fixture
def anyio_backend() -> str:
    """``pytest.mark.anyio`` tests run on asyncio only: the SDK and servers are asyncio."""
    return "asyncio"


@pytest.fixture
def on_both_databases(database_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test once per backend (tests/conftest.py ``database_url``): every control
    app it starts through ``control_app`` or ``LiveApi`` uses that database.
    Modules of DB-level tests ask for it with ``pytest.mark.usefixtures``."""
    monkeypatch.setattr(fakes, "DATABASE_URL", database_url)
    return database_url


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[LiveApi]:
    """The control app over a FakeNode, its lifespan on the test's loop (async tests)."""
    async with LiveApi(tmp_path / "control").running() as live:
        yield live


@pytest.fixture
def sync_api(tmp_path: Path) -> Iterator[LiveApi]:
    """The control app over a FakeNode, its lifespan on the sync SDK's loop thread (tests
    of ``Sandbox``, ``Space`` and the CLI)."""
    with LiveApi(tmp_path / "control").serving_sync() as live:
        yield live


@pytest.fixture
def egress_dir(tmp_path: Path) -> Iterator[Path]:
    """The gateway's data dir, with a root broker whose run root is its sibling ``run``
    (``gateway_broker``); every gateway started on it is gone afterwards."""
    directory = tmp_path / "egress"
    with root_broker(tmp_path):
        yield directory
    for pid in running_gateways(directory):
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"a gateway was left running: pid {pid}")
