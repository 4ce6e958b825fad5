"""The SDK's templates: packing a directory, and build/list/delete against the control app."""

from __future__ import annotations

import asyncio
import gzip
import io
import os
import tarfile
import threading
from pathlib import Path

import httpx
import pytest

from space.sdk import AsyncTemplate, BuildError, Template, TemplateInfo
from space.sdk._pack import plan_context, stream_context
from space.sdk.errors import Conflict, InvalidArgument, NotFound
from tests.unit.fakes import Harness, control_app

pytestmark = pytest.mark.anyio

SPEC = 'name = "py"\ntag = "v1"\nbase = "debian:bookworm"\n'


def project(root: Path, spec: str = SPEC, spec_name: str = "space.toml") -> Path:
    (root / "app").mkdir(parents=True)
    (root / "app" / "main.py").write_bytes(b"print(1)\n")
    (root / spec_name).write_text(spec)
    return root


async def packed(root: Path, spec: str = "space.toml") -> dict[str, bytes | None]:
    """What the SDK would send for ``root``: entries by name (None for directories)."""
    data = b"".join([chunk async for chunk in stream_context(plan_context(root, spec))])
    entries: dict[str, bytes | None] = {}
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data)), mode="r:") as tar:
        for member in tar:
            assert member.isdir() or member.isfile(), member.name
            file = tar.extractfile(member) if member.isfile() else None
            entries[member.name] = file.read() if file is not None else None
    return entries


async def test_a_directory_is_packed_with_its_spec_first_as_space_toml(tmp_path: Path) -> None:
    entries = await packed(project(tmp_path))
    assert list(entries) == ["space.toml", "app", "app/main.py"]
    assert entries["space.toml"] == SPEC.encode() and entries["app"] is None


async def test_a_spec_of_another_name_is_sent_as_space_toml_and_shadows_the_root_one(
    tmp_path: Path,
) -> None:
    project(tmp_path, spec_name="prod.toml")
    (tmp_path / "space.toml").write_text("stale")
    entries = await packed(tmp_path, "prod.toml")
    assert entries["space.toml"] == SPEC.encode()
    assert list(entries).count("space.toml") == 1 and "prod.toml" in entries


async def test_a_symlink_inside_the_directory_is_sent_as_what_it_points_to(
    tmp_path: Path,
) -> None:
    project(tmp_path)
    (tmp_path / "alias.py").symlink_to("app/main.py")
    (tmp_path / "lib").symlink_to("app", target_is_directory=True)
    entries = await packed(tmp_path)
    assert entries["alias.py"] == b"print(1)\n"
    assert entries["lib"] is None and entries["lib/main.py"] == b"print(1)\n"


async def test_negative_a_symlink_pointing_outside_is_refused_by_name(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    (tmp_path / "secret").write_text("key")
    (root / "app" / "keys").symlink_to(tmp_path / "secret")
    with pytest.raises(InvalidArgument, match=r"symlink .*app/keys points outside") as caught:
        plan_context(root)
    assert caught.value.details["path"].endswith("app/keys")


@pytest.mark.parametrize("kind", ["cycle", "fifo", "missing-spec", "spec-outside"])
async def test_negative_what_cannot_be_packed_is_refused_before_sending(
    tmp_path: Path, kind: str
) -> None:
    root = project(tmp_path / "p")
    spec = "space.toml"
    if kind == "cycle":
        (root / "app" / "up").symlink_to(root, target_is_directory=True)
    elif kind == "fifo":
        os.mkfifo(root / "pipe")
    elif kind == "missing-spec":
        spec = "nope.toml"
    else:
        (tmp_path / "out.toml").write_text(SPEC)
        spec = "../out.toml"
    with pytest.raises(InvalidArgument):
        plan_context(root, spec)


async def test_closing_the_stream_early_stops_the_packing_thread(tmp_path: Path) -> None:
    project(tmp_path)
    (tmp_path / "big").write_bytes(os.urandom(4 << 20))
    stream = stream_context(plan_context(tmp_path))
    assert await anext(stream)
    await asyncio.wait_for(stream.aclose(), 5)


def _connection(h: Harness, tenant: str = "acme") -> dict[str, object]:
    key = h.key(tenant)["Authorization"].removeprefix("Bearer ")
    return {"api_key": key, "_transport": httpx.ASGITransport(app=h.app)}


async def test_build_list_and_delete_against_the_control_plane(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    async with control_app(tmp_path / "data") as h:
        conn = _connection(h)
        log: list[str] = []
        built = await AsyncTemplate.build(root, on_log=log.append, **conn)  # type: ignore[arg-type]
        listed = await AsyncTemplate.list(**conn)  # type: ignore[arg-type]
        await AsyncTemplate.delete(built, **conn)  # type: ignore[arg-type]
        with pytest.raises(NotFound):
            await AsyncTemplate.delete("py:v1", **conn)  # type: ignore[arg-type]
        with pytest.raises(Conflict):
            await AsyncTemplate.delete("base", **conn)  # type: ignore[arg-type]
        after = await AsyncTemplate.list(**conn)  # type: ignore[arg-type]
        assert h.node.contexts[0]["app/main.py"] == b"print(1)\n"
    assert isinstance(built, TemplateInfo) and built.ref == "py:v1" and len(built.digest) == 64
    assert log == ["step 1/2 run: building py:v1", "step 2/2 config: done"]
    assert [t.ref for t in listed] == ["base:latest", "py:v1"]
    assert [t.ref for t in after] == ["base:latest"]


async def test_negative_a_failed_build_raises_build_error_with_the_step(tmp_path: Path) -> None:
    root = project(tmp_path / "p", SPEC + '[[steps]]\nrun = "fail"\n')
    async with control_app(tmp_path / "data") as h:
        with pytest.raises(BuildError) as caught:
            await AsyncTemplate.build(root, **_connection(h))  # type: ignore[arg-type]
    assert (caught.value.step, caught.value.error_code) == (1, "build_failed")
    assert caught.value.build_message == "py: step failed"
    assert "step 1" in str(caught.value)


async def test_negative_a_malformed_reference_is_refused_without_a_request() -> None:
    transport = httpx.MockTransport(lambda request: pytest.fail("sent"))
    for ref in ("Py", "py:v1/../x", "py@123"):
        with pytest.raises(InvalidArgument):
            await AsyncTemplate.delete(ref, _transport=transport)


def test_the_sync_template_builds_and_lists(tmp_path: Path) -> None:
    # The control app runs on its own loop thread; the sync facade drives it from here.
    root = project(tmp_path / "p")

    async def serve(ready: asyncio.Event, done: asyncio.Event, out: dict[str, object]) -> None:
        async with control_app(tmp_path / "data") as h:
            out.update(_connection(h))
            ready.set()
            await done.wait()

    loop = asyncio.new_event_loop()
    ready, done, conn = asyncio.Event(), asyncio.Event(), dict[str, object]()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(ready, done, conn),))
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(ready.wait(), loop).result(10)
        built = Template.build(root, **conn)  # type: ignore[arg-type]
        refs = [t.ref for t in Template.list(**conn)]  # type: ignore[arg-type]
    finally:
        loop.call_soon_threadsafe(done.set)
        thread.join(10)
        loop.close()
    assert built.ref == "py:v1" and refs == ["base:latest", "py:v1"]
