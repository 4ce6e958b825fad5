"""SDK calls against the fake API that many SDK tests make the same way."""

from __future__ import annotations

from typing import Any

from space.sdk import AsyncSandbox
from tests.unit.test_sdk_fake_api import API_KEY, FakeApi


def connection(fake: FakeApi) -> dict[str, Any]:
    """The connection arguments of an SDK classmethod call that reaches ``fake``."""
    return {"api_url": "http://space", "api_key": API_KEY, "_transport": fake.transport()}


async def create(fake: FakeApi, **options: Any) -> AsyncSandbox:
    """``AsyncSandbox.create(**options)`` on ``fake``."""
    return await AsyncSandbox.create(**connection(fake), **options)


def bodies(fake: FakeApi, suffix: str) -> list[Any]:
    """The JSON bodies ``fake`` received on paths ending with ``suffix``, in order."""
    return [body for _, path, body in fake.bodies if path.endswith(suffix)]
