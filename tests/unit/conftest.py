"""Fixtures the unit tests share: the async backend and the real API over a FakeNode."""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from space.node.artifacts import ArtifactStore, FilesystemStore, S3Settings, S3Store
from space.node.artifacts._s3 import MIN_PART_BYTES
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


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server process for the whole session (tests/unit/_moto.py); each test
    makes a bucket of its own."""
    from tests.unit._moto import moto_server

    with moto_server() as url:
        yield url


@pytest.fixture(params=["fs", "s3"])
def artifact_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ArtifactStore]:
    """Each artifact store backend in turn, empty: a directory, or a fresh bucket on the
    session's moto server (S3 parts of the least size S3 takes, 5 MiB, so a test's
    object of a few MiB goes up in several)."""
    if request.param == "fs":
        yield FilesystemStore(tmp_path / "artifacts")
        return
    from tests.unit._moto import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY

    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"artifacts-{secrets.token_hex(6)}"
    settings = S3Settings(
        bucket=bucket,
        endpoint_url=endpoint,
        region=REGION,
        access_key_id=ACCESS_KEY_ID,
        secret_access_key=SECRET_ACCESS_KEY,
        part_bytes=MIN_PART_BYTES,
    )
    store = S3Store(settings)
    store._client.create_bucket(Bucket=bucket)
    yield store
