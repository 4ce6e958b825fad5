"""A gVisor sandbox through the whole platform (issue 21): the SDK's
``Sandbox.create(guest="gvisor")`` against ``space serve`` (its node agent
unprivileged, root kept by its broker), a command, a file, the guest type reported,
and kill."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from space import InvalidArgument, Sandbox

from .platform import Platform, running_platform

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("space-gvisor")) as p:
        yield p


def test_the_sdk_creates_a_gvisor_sandbox_and_uses_it(platform: Platform) -> None:
    key = platform.create_key("tenant-g")
    sandbox = Sandbox.create(api_url=platform.url, api_key=key, guest="gvisor")
    try:
        assert sandbox.get_info().guest == "gvisor"
        result = sandbox.commands.run("echo hi from $(uname -s); dmesg | head -1")
        assert result.exit_code == 0
        assert result.stdout.startswith("hi from Linux\n")
        sandbox.files.write("/home/user/note.txt", "written by the SDK")
        assert sandbox.files.read("/home/user/note.txt") == "written by the SDK"
    finally:
        sandbox.kill()
    with pytest.raises(InvalidArgument):
        Sandbox.create(api_url=platform.url, api_key=key, guest="xen")  # type: ignore[arg-type]
