"""Hostile tenant, issue 17 probe 4 ("one tenant fills the node"), on a real `space
serve`: tenant A, at the quotas the operator set with `space quota set` while the server
runs, is refused with 429 naming the quota, whether it creates more or hibernates
more, and tenant B creates and runs meanwhile."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import httpx
import pytest

from space import Sandbox
from space.sdk import ResourceExhausted
from tests.integration.platform import SPACE, Platform, running_platform

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("space-quotas")) as p:
        yield p


def _quota_set(platform: Platform, tenant: str, *options: str) -> None:
    args = ["quota", "set", "--tenant", tenant, *options, "--data-dir", str(platform.data_dir)]
    subprocess.run([*SPACE, *args], check=True, capture_output=True, timeout=60)


def test_tenant_a_at_its_quotas_is_refused_while_tenant_b_creates_and_runs(
    platform: Platform,
) -> None:
    key_a, key_b = platform.create_key("tenant-a"), platform.create_key("tenant-b")
    _quota_set(platform, "tenant-a", "--running-sandboxes", "1", "--suspended-sandboxes", "1")
    made: list[Sandbox] = []
    try:
        made.append(Sandbox.create(api_url=platform.url, api_key=key_a))
        made[0].hibernate()
        made.append(Sandbox.create(api_url=platform.url, api_key=key_a))
        with pytest.raises(ResourceExhausted) as refused:
            made.append(Sandbox.create(api_url=platform.url, api_key=key_a))
        assert (refused.value.quota, refused.value.limit, refused.value.used) == (
            "running_sandboxes", 1, 1,
        )  # fmt: skip
        with pytest.raises(ResourceExhausted) as refused:
            made[1].hibernate()
        assert refused.value.quota == "suspended_sandboxes"
        # B is untouched by A's quotas: it creates and runs.
        made.append(Sandbox.create(api_url=platform.url, api_key=key_b))
        assert made[-1].commands.run("echo ok").stdout == "ok\n"
        answer = httpx.get(
            f"{platform.url}/v1/quota", headers={"X-API-Key": key_a}, timeout=30
        ).json()
        assert answer["quotas"]["running_sandboxes"] == {
            "limit": 1, "used": 1, "unit": "sandboxes",
        }  # fmt: skip
        assert answer["quotas"]["suspended_sandboxes"]["used"] == 1
    finally:
        for sandbox in made:
            sandbox.kill()
