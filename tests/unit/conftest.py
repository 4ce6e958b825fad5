"""Fixtures the unit tests share: the async backend and a fresh fake API."""

from __future__ import annotations

import pytest

from tests.unit.test_sdk_fake_api import FakeApi


@pytest.fixture
def anyio_backend() -> str:
    """``pytest.mark.anyio`` tests run on asyncio only: the SDK and servers are asyncio."""
    return "asyncio"


@pytest.fixture
def fake() -> FakeApi:
    """An empty fake API (tests/unit/test_sdk_fake_api.py); a test module may override it."""
    return FakeApi()
