"""The sync SDK's interactive calls (issue 20) against the real API over a FakeNode."""

from __future__ import annotations

from space.node.api import PtySize
from space.sdk import PtySize as SdkPtySize
from space.sdk import Sandbox
from tests.unit._live_api import LiveApi
from tests.unit.test_interactive_layers import _CHANGES


def test_the_sync_sdk_feeds_resizes_finds_by_tag_and_watches(sync_api: LiveApi) -> None:
    sandbox = Sandbox.create(**sync_api.connection())
    try:
        sid = sandbox.sandbox_id
        handle = sandbox.commands.run("sh", background=True, pty=SdkPtySize(9, 9), tag="s")
        handle.send_stdin("ls\n")
        handle.resize(SdkPtySize(10, 11))
        sandbox.commands.connect(tag="s").close_stdin()
        sync_api.node.boxes[sid].dirs.add("/home/user/d")
        sync_api.node.watch_events[sid] = _CHANGES
        events = list(sandbox.files.watch_dir("/home/user/d"))
    finally:
        sandbox.kill()
    key = (sid, handle.process_id)
    assert sync_api.node.stdin[key] == b"ls\n" and key in sync_api.node.stdin_closed
    assert sync_api.node.pty_sizes[key] == PtySize(10, 11)
    assert [e.type for e in events] == ["create", "dropped", "rename"]
