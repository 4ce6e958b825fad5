"""The node on real VMs: create, exec, delete, restart with re-adoption, cleanup.

Each test boots as few VMs as it can (TCG boots take seconds on these machines).
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from space.node.agent import Node
from space.node.api import (
    Conflict,
    ExecExited,
    ExecOutput,
    ExecRequest,
    InvalidArgument,
    NotFound,
    SandboxSpec,
    SandboxState,
    Unavailable,
)
from space.node.storage.disks import disk_format

from .conftest import NodeHarness
from .platform import qemu_pids

pytestmark = pytest.mark.vm


async def _run(node: Node, sandbox_id: str, request: ExecRequest) -> tuple[str, str, int | None]:
    stream = await node.exec(sandbox_id, request)
    out, err, code = b"", b"", None
    async for event in stream:
        if isinstance(event, ExecOutput):
            if event.stream == "stdout":
                out += event.data
            else:
                err += event.data
        elif isinstance(event, ExecExited):
            code = event.exit_code
    return out.decode(), err.decode(), code


def _leftovers(h: NodeHarness, sandbox_id: str, pid: int | None) -> list[str]:
    """Everything of a sandbox that should be gone after its deletion."""
    left = []
    if pid is not None and Path(f"/proc/{pid}").exists():
        left.append(f"qemu pid {pid}")
    data = h.config.data_dir
    for path in (
        data / "pool" / "sandboxes" / sandbox_id,
        data / "sandboxes" / f"{sandbox_id}.json",
        data / "sandboxes" / f"{sandbox_id}.console.log",
        h.config.effective_run_dir / sandbox_id,
    ):
        if path.exists():
            left.append(str(path))
    return left


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_create_exec_and_delete_leaves_nothing_behind(
    node: NodeHarness, record_property: Callable[[str, object], None]
) -> None:
    spec = SandboxSpec("it-basic", memory_mib=256, env={"GREETING": "hello", "KEEP": "1"})
    start = time.monotonic()
    status = node.run(node.node.create_sandbox(spec))
    out, err, code = node.run(_run(node.node, spec.sandbox_id, ExecRequest(argv=["echo", "hi"])))
    create_s = time.monotonic() - start
    assert (out, code) == ("hi\n", 0), err
    assert status.state == SandboxState.RUNNING and status.vmm_pid is not None
    record_property("create_to_first_exec_s", round(create_s, 2))

    # The sandbox env is the default of every exec; the request's env overrides it.
    req = ExecRequest(cmd="echo $GREETING-$KEEP", env={"GREETING": "bye"})
    assert node.run(_run(node.node, spec.sandbox_id, req))[0] == "bye-1\n"
    hostname = node.run(_run(node.node, spec.sandbox_id, ExecRequest(argv=["hostname"])))[0]
    assert hostname.strip() == "it-basic"

    # Same id and spec again: idempotent; another spec: Conflict.
    assert node.run(node.node.create_sandbox(spec)).vmm_pid == status.vmm_pid
    with pytest.raises(Conflict):
        node.run(node.node.create_sandbox(SandboxSpec("it-basic", memory_mib=512)))

    time.sleep(2)  # let the guest settle before measuring idle RSS
    rss_mib = _rss_kib(status.vmm_pid) / 1024
    record_property("idle_qemu_rss_mib", round(rss_mib))
    print(f"\ncreate to first exec: {create_s:.2f} s; idle 256 MiB QEMU RSS {rss_mib:.0f} MiB")

    node.run(node.node.delete_sandbox(spec.sandbox_id))
    node.run(node.node.delete_sandbox(spec.sandbox_id))  # idempotent
    assert _leftovers(node, spec.sandbox_id, status.vmm_pid) == []
    assert qemu_pids(node.config.data_dir) == []
    with pytest.raises(NotFound):
        node.run(node.node.get_sandbox(spec.sandbox_id))


def _holds(image: Path, needle: bytes) -> bool:
    """Whether ``needle`` is anywhere in the data of ``image`` (read past its holes)."""
    with open(image, "rb") as f:
        end, offset = os.fstat(f.fileno()).st_size, 0
        while offset < end:
            try:
                offset = os.lseek(f.fileno(), offset, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                return False
            chunk = os.pread(f.fileno(), 8 << 20, offset)
            if needle in chunk:
                return True
            offset += max(len(chunk) - len(needle), 1)
    return False


def test_the_guest_disk_is_encrypted_on_the_host_and_its_filesystem_fills_its_size(
    node: NodeHarness,
) -> None:
    spec = SandboxSpec("it-disk", memory_mib=256, disk_mib=1536)
    node.run(node.node.create_sandbox(spec))
    marker = secrets.token_hex(32)
    script = f"printf {marker} > ~/marker && sync && df -k --output=size / | tail -1"
    out, err, code = node.run(_run(node.node, spec.sandbox_id, ExecRequest(cmd=script)))
    assert code == 0, err
    # The guest grew its ext4 to the disk as it booted: all of it less ext4's overhead.
    assert 1536 * 1024 * 0.95 < int(out) <= 1536 * 1024
    rootfs = node.config.data_dir / "pool" / "sandboxes" / spec.sandbox_id / "rootfs.img"
    assert disk_format(rootfs) == "luks"
    assert not _holds(rootfs, marker.encode())
    assert _holds(rootfs, b"LUKS\xba\xbe")  # the search itself finds what is there
    node.run(node.node.delete_sandbox(spec.sandbox_id))


def test_node_restart_readopts_a_running_sandbox_and_its_processes(node: NodeHarness) -> None:
    spec = SandboxSpec("it-readopt")
    status = node.run(node.node.create_sandbox(spec))
    bg = node.run(
        node.node.exec(spec.sandbox_id, ExecRequest(argv=["sleep", "600"], background=True))
    )
    node.run(bg.aclose())

    node.restart()

    again = node.run(node.node.get_sandbox(spec.sandbox_id))
    assert (again.state, again.vmm_pid) == (SandboxState.RUNNING, status.vmm_pid)
    out, _, code = node.run(_run(node.node, spec.sandbox_id, ExecRequest(argv=["echo", "back"])))
    assert (out, code) == ("back\n", 0)
    processes = node.run(node.node.list_processes(spec.sandbox_id))
    assert any(p.process_id == bg.process_id and p.running for p in processes), processes


def test_sandbox_whose_qemu_died_while_the_node_was_down_is_cleaned_up(node: NodeHarness) -> None:
    spec = SandboxSpec("it-dead")
    status = node.run(node.node.create_sandbox(spec))
    assert status.vmm_pid is not None
    node.run(node.node.close())
    os.kill(status.vmm_pid, signal.SIGKILL)
    time.sleep(0.5)

    node.node = node.run(Node.start(node.config))

    assert node.run(node.node.list_sandboxes()) == []
    assert _leftovers(node, spec.sandbox_id, status.vmm_pid) == []


def test_qemu_exiting_under_a_running_node_puts_the_sandbox_in_error(node: NodeHarness) -> None:
    spec = SandboxSpec("it-crash")
    status = node.run(node.node.create_sandbox(spec))
    assert status.vmm_pid is not None
    os.kill(status.vmm_pid, signal.SIGKILL)

    async def wait_for_error() -> SandboxState:
        import asyncio

        for _ in range(100):
            state = (await node.node.get_sandbox(spec.sandbox_id)).state
            if state == SandboxState.ERROR:
                return state
            await asyncio.sleep(0.05)
        return state

    assert node.run(wait_for_error()) == SandboxState.ERROR
    with pytest.raises(Unavailable):
        node.run(_run(node.node, spec.sandbox_id, ExecRequest(argv=["true"])))
    node.run(node.node.delete_sandbox(spec.sandbox_id))
    assert _leftovers(node, spec.sandbox_id, status.vmm_pid) == []


@pytest.mark.parametrize(
    "field, value",
    [
        ("cpus", 0),
        ("cpus", 9),
        ("memory_mib", 127),
        ("memory_mib", 16385),
        ("disk_mib", 65537),
        ("disk_mib", 1),
    ],
)
def test_negative_out_of_range_resources_are_refused_and_create_nothing(
    node: NodeHarness, field: str, value: int
) -> None:
    spec = SandboxSpec("it-bad", **{field: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        node.run(node.node.create_sandbox(spec))
    assert node.run(node.node.list_sandboxes()) == []
    assert _leftovers(node, "it-bad", None) == []


def test_negative_unknown_sandbox_and_template_are_not_found(node: NodeHarness) -> None:
    with pytest.raises(NotFound):
        node.run(node.node.get_sandbox("nope"))
    with pytest.raises(NotFound):
        node.run(node.node.exec("nope", ExecRequest(argv=["true"])))
    with pytest.raises(NotFound):
        node.run(node.node.create_sandbox(SandboxSpec("it-tpl", template="missing")))
    with pytest.raises(InvalidArgument):
        node.run(node.node.create_sandbox(SandboxSpec("../escape")))
    assert node.run(node.node.list_sandboxes()) == []
