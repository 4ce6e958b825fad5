"""The SDK's secrets against the control plane over a FakeNode: ``Secrets`` and
``create(secrets=...)`` (issue 5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from space.sdk import AsyncSandbox, AsyncSecrets, SecretBinding
from space.sdk.errors import InvalidArgument, NotFound
from tests.unit.fakes import control_app

pytestmark = pytest.mark.anyio

VALUE = "sk-sdk-91c3-never-echoed"


async def test_set_list_get_delete_and_a_sandbox_using_the_secret(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")["Authorization"].removeprefix("Bearer ")
        connect: dict[str, Any] = {"api_key": key, "_transport": httpx.ASGITransport(app=h.app)}
        info = await AsyncSecrets.set("OPENAI", VALUE, ["api.openai.com"], env="OPENAI_API_KEY",
                                      **connect)  # fmt: skip
        header = await AsyncSecrets.set("API", VALUE, ["*.example.com"], injection="header",
                                        header="Authorization", format="Bearer {value}",
                                        **connect)  # fmt: skip
        listed = await AsyncSecrets.list(**connect)
        got = await AsyncSecrets.get("OPENAI", **connect)
        sandbox = await AsyncSandbox.create(secrets=["OPENAI"], **connect)
        fresh = await sandbox.get_info()
        await AsyncSecrets.delete("OPENAI", **connect)
        await AsyncSecrets.delete("OPENAI", **connect)  # idempotent
        with pytest.raises(NotFound):
            await AsyncSecrets.get("OPENAI", **connect)
        await sandbox.kill()
    assert (info.name, info.env, info.hosts, info.injection) == (
        "OPENAI", "OPENAI_API_KEY", ("api.openai.com",), "placeholder"
    )  # fmt: skip
    assert (header.header, header.format) == ("Authorization", "Bearer {value}")
    assert [s.name for s in listed] == ["API", "OPENAI"] and got == info
    (binding,) = fresh.secrets
    assert isinstance(binding, SecretBinding) and binding.env == "OPENAI_API_KEY"
    assert binding.placeholder.startswith("space_ph_")
    assert VALUE not in repr((info, header, listed, fresh))


async def test_negative_a_bad_value_is_invalid_argument_without_the_value(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")["Authorization"].removeprefix("Bearer ")
        connect: dict[str, Any] = {"api_key": key, "_transport": httpx.ASGITransport(app=h.app)}
        with pytest.raises(InvalidArgument) as caught:
            await AsyncSecrets.set("N", VALUE + "\n", ["a.org"], **connect)
        with pytest.raises(InvalidArgument, match="no secret 'MISSING'"):
            await AsyncSandbox.create(secrets=["MISSING"], **connect)
    assert "control character" in str(caught.value) and VALUE not in str(caught.value)
    assert VALUE not in repr(caught.value.details)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: AsyncSecrets.set("a/b", VALUE, ["a.org"]), "a secret name is"),
        (lambda: AsyncSecrets.set("N", VALUE, "a.org"), "not a string"),
        (lambda: AsyncSecrets.get("../x"), "a secret name is"),
        (lambda: AsyncSecrets.delete(""), "a secret name is"),
        (lambda: AsyncSandbox.create(secrets="OPENAI"), "not a string"),
    ],
)
async def test_negative_malformed_arguments_are_refused_before_sending(
    call: Any, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message) as caught:
        await call()
    assert VALUE not in str(caught.value)
