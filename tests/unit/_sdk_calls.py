"""SDK calls against the real API (tests/unit/_live_api.py) that many SDK tests make."""

from __future__ import annotations

from typing import Any

from space.sdk import AsyncSandbox
from tests.unit._live_api import LiveApi


def connection(api: LiveApi) -> dict[str, Any]:
    """The connection arguments of an SDK classmethod call that reaches ``api``."""
    return api.connection()


async def create(api: LiveApi, **options: Any) -> AsyncSandbox:
    """``AsyncSandbox.create(**options)`` on ``api``."""
    return await AsyncSandbox.create(**connection(api), **options)


def bodies(api: LiveApi, suffix: str) -> list[Any]:
    """The JSON bodies ``api`` received on paths ending with ``suffix``, in order."""
    return [body for _, path, body in api.bodies if path.endswith(suffix)]
