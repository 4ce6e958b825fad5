"""A gVisor sandbox through the whole platform (issue 21): the SDK's
``Sandbox.create(guest="gvisor")`` against ``space serve`` (its node agent
unprivileged, root kept by its broker), a command, a file, the guest type reported,
and kill; and one of a template built through the platform, whose tree the
unprivileged agent has root unpack from the build's encrypted disk."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from space import InvalidArgument, Sandbox
from space.sdk import Template

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


def test_the_sdk_creates_a_gvisor_sandbox_of_a_built_template(
    platform: Platform, tmp_path: Path
) -> None:
    key = platform.create_key("tenant-t")
    (tmp_path / "space.toml").write_text(
        textwrap.dedent("""\
        name = "gv-sdk"
        base = "debian:bookworm"
        env = { FROM = "the template" }
        workdir = "/opt"

        [[steps]]
        run = "echo built > /opt/step.txt"
        """)
    )
    info = Template.build(tmp_path, api_url=platform.url, api_key=key)
    sandbox = Sandbox.create(
        template=f"{info.name}:{info.tag}", api_url=platform.url, api_key=key, guest="gvisor"
    )
    try:
        assert sandbox.get_info().guest == "gvisor"
        result = sandbox.commands.run('cat step.txt; echo "$FROM"')
        assert (result.exit_code, result.stdout) == (0, "built\nthe template\n")
    finally:
        sandbox.kill()
        Template.delete(f"{info.name}:{info.tag}", api_url=platform.url, api_key=key)
