"""Saved VM states are sealed at rest (issue 18), on real VMs through the Node.

A random token written into guest RAM (a tmpfs file) is in the plaintext of the
hibernated sandbox's ``vmstate`` (the control: what an unsealed save writes) and not in
the file; the sandbox wakes with it. A flipped bit stops the wake with Unavailable and
leaves the sandbox hibernated, and a plaintext state from before sealing still wakes.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import threading
from pathlib import Path

import pytest

from space.node.api import SandboxState, Unavailable
from space.node.core.keys import NodeKeys
from space.node.vmm.sealed_state import CHUNK_BYTES, HEADER_BYTES, MAGIC, open_chunks

from .conftest import NodeHarness
from .platform import qemu_pids
from .test_lifecycle import _create, _sh, _state, _volume

pytestmark = pytest.mark.vm


def _unsealed(h: NodeHarness, blob: bytes) -> bytes:
    key = NodeKeys.load(h.config.effective_key_file).state_key
    return b"".join(open_chunks(key, io.BytesIO(blob).read))


def _pipes() -> int:
    """Pipes this process (the node) holds open."""
    pipes = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            pipes += os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    return pipes


def _state_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("seal-", "open-"))]


def _hibernated_state(h: NodeHarness, sandbox_id: str) -> Path:
    assert h.run(h.node.hibernate_sandbox(sandbox_id)).state == SandboxState.HIBERNATED
    assert qemu_pids(h.config.data_dir) == []
    return _volume(h, sandbox_id) / "vmstate"


def test_a_hibernated_sandbox_keeps_its_ram_sealed_on_disk_and_wakes_with_it(
    node: NodeHarness,
) -> None:
    _create(node, "sealed")
    token = secrets.token_hex(24)
    _sh(node, "sealed", f"printf %s {token} > /dev/shm/token")
    pipes = _pipes()

    blob = _hibernated_state(node, "sealed").read_bytes()
    assert (_state_threads(), _pipes()) == ([], pipes)  # the sealing left nothing open

    assert blob.startswith(MAGIC)
    assert token.encode() not in blob
    plain = _unsealed(node, blob)
    assert plain.startswith(b"QEVM")  # QEMU's own stream, as a save without a key writes it
    assert token.encode() in plain  # so the check above could fail
    assert _sh(node, "sealed", "cat /dev/shm/token") == token  # woken by the exec
    assert _state(node, "sealed") == SandboxState.RUNNING
    assert (_state_threads(), _pipes()) == ([], pipes)


def test_negative_a_flipped_bit_stops_the_wake_and_a_plaintext_state_still_wakes(
    node: NodeHarness,
) -> None:
    _create(node, "tampered")
    token = secrets.token_hex(24)
    _sh(node, "tampered", f"printf %s {token} > /dev/shm/token")
    path = _hibernated_state(node, "tampered")
    blob = path.read_bytes()
    flipped = bytearray(blob)
    flipped[HEADER_BYTES + CHUNK_BYTES + 16 + 1000] ^= 0x01  # in the second chunk
    path.write_bytes(flipped)

    with pytest.raises(Unavailable, match="saved state of sandbox tampered does not authenticate"):
        node.run(node.node.resume_sandbox("tampered"))

    assert _state(node, "tampered") == SandboxState.HIBERNATED
    assert qemu_pids(node.config.data_dir) == [] and _state_threads() == []
    path.write_bytes(_unsealed(node, blob))  # as a node before issue 18 saved it
    assert node.run(node.node.resume_sandbox("tampered")).state == SandboxState.RUNNING
    assert _sh(node, "tampered", "cat /dev/shm/token") == token
