"""A VM's cgroup is removed in the background once its VMM exits (Jail.release); a VM
of the same name launched meanwhile (a sandbox resumed right after its hibernation)
waits for that release, which would otherwise remove the new VM's cgroup before its
VMM joined it ("joining cgroup ...: No such file or directory")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from space.node.privileged.requests import LaunchVm, ReleaseVm, Request
from space.node.vmm import jail as jail_module
from space.node.vmm.jail import Jail


class _Broker:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.release_may_end = asyncio.Event()

    async def call(self, request: Request, **_: object) -> object:
        if isinstance(request, ReleaseVm):
            await self.release_may_end.wait()  # a slow release
            self.calls.append(("release", request.name))
            return None
        assert isinstance(request, LaunchVm)
        self.calls.append(("launch", request.name))
        return 4242


async def _spawn(jail: Jail, name: str) -> int:
    return await jail.spawn(
        name,
        ["qemu-system-x86_64"],
        binds=[],
        owned=[],
        netns=None,
        tap="tap0",
        memory_mib=64,
        cpus=1,
        stderr_log=Path("/nonexistent/stderr"),
        pid_file=Path("/nonexistent/pid"),
    )


def test_a_launch_waits_for_the_release_of_a_vm_of_its_name_and_no_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario() -> list[tuple[str, str]]:
        broker = _Broker()
        monkeypatch.setattr(jail_module, "broker_for", lambda _run_root: broker)
        jail = Jail(Path("/run/space-test"))
        jail.release("sb-1")
        assert await _spawn(jail, "sb-2") == 4242  # another name goes on at once
        same = asyncio.create_task(_spawn(jail, "sb-1"))
        await asyncio.sleep(0.05)
        assert not same.done()
        broker.release_may_end.set()
        assert await same == 4242
        assert await _spawn(jail, "sb-1") == 4242  # the release is over: nothing waits
        return broker.calls

    assert asyncio.run(scenario()) == [
        ("launch", "sb-2"),
        ("release", "sb-1"),
        ("launch", "sb-1"),
        ("launch", "sb-1"),
    ]
