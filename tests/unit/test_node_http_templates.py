"""Template builds, listing and deletion through the node's HTTP API and RemoteNode."""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import cast

import httpx
import pytest

from space.node.api import (
    BUILD_ID_HEADER,
    MAX_BUILD_LOG_BYTES,
    BuildEvent,
    BuildFailed,
    BuildLog,
    BuildSucceeded,
    Conflict,
    InvalidArgument,
    NodeError,
    NodeService,
    NotFound,
    TemplateInfo,
    Unavailable,
    build_event_line,
    build_lines,
    decode_build_event,
    encode,
)
from space.node.http._answers import MAX_LINE_BYTES
from space.node.http.client import RemoteNode
from space.node.http.server import create_node_app
from space.node.templates import load_spec, parse_ref, unpack_context

pytestmark = pytest.mark.anyio

TOKEN = "node-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DIGEST = "ab" * 32
SPEC = b'name = "py-data"\ntag = "v1"\nbase = "debian:bookworm"\n'
# Every optional field set and a fractional time, so a dropped field shows.
INFO = TemplateInfo(
    "py-data",
    "v1",
    DIGEST,
    1_800_000_000.25,
    "debian:bookworm",
    2,
    512,
    4096,
    {"LANG": "C.UTF-8", "Q": 'a "quoted" \u00e9'},
    "/home/user/work",
    "python3 -m http.server",
    True,
)
BASE = TemplateInfo("base", "latest", "cd" * 32, 1_700_000_000.0, "debian:bookworm", 1, 256, 2048)


class _FakeBuild:
    """A BuildStream replaying ``events``, then raising ``error`` if given."""

    def __init__(self, events: list[BuildEvent], error: Exception | None = None) -> None:
        self.build_id = "build-7f3a"
        self.events = events
        self.error = error
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[BuildEvent]:
        for event in self.events:
            yield event
        if self.error is not None:
            raise self.error

    async def aclose(self) -> None:
        self.closed = True


class TemplateNode:
    """Only NodeService's three template methods, with the real context unpacking."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.templates = [BASE, INFO]
        self.deleted: list[str] = []
        self.specs: list[str] = []
        self.events: list[BuildEvent] = [BuildLog("step 1/1 config"), BuildSucceeded(INFO)]
        self.stream_error: Exception | None = None
        self.builds: list[_FakeBuild] = []
        self.attempts = 0

    async def build_template(self, context: AsyncIterable[bytes]) -> _FakeBuild:
        self.attempts += 1
        dest = self.workdir / f"ctx-{self.attempts}"
        dest.mkdir()
        spec = load_spec(await unpack_context(context, dest))
        self.specs.append(f"{spec.name}:{spec.tag}")
        self.builds.append(_FakeBuild(self.events, self.stream_error))
        return self.builds[-1]

    async def list_templates(self) -> list[TemplateInfo]:
        return list(self.templates)

    async def delete_template(self, ref: str) -> None:
        parsed = parse_ref(ref)
        if parsed.name == "base":
            raise Conflict("the base template cannot be deleted")
        if parsed.name != "py-data":
            raise NotFound(f"no template {ref}")
        self.deleted.append(ref)


@pytest.fixture
def node(tmp_path: Path) -> TemplateNode:
    return TemplateNode(tmp_path)


def _app_transport(node: TemplateNode) -> httpx.ASGITransport:
    # The routes under test reach only the three template methods the fake has.
    return httpx.ASGITransport(app=create_node_app(cast(NodeService, node), TOKEN))


@contextlib.asynccontextmanager
async def _remote(transport: httpx.AsyncBaseTransport) -> AsyncIterator[RemoteNode]:
    client = RemoteNode("http://node", TOKEN, transport=transport)
    try:
        yield client
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def _http(node: TemplateNode) -> AsyncIterator[httpx.AsyncClient]:
    base = "http://node/node/v1"
    async with httpx.AsyncClient(transport=_app_transport(node), base_url=base) as client:
        yield client


def _context(*files: tuple[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


async def _chunks(data: bytes, size: int = 512) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def _events(client: RemoteNode, context: bytes) -> tuple[str, list[BuildEvent]]:
    stream = await client.build_template(_chunks(context))
    try:
        return stream.build_id, [event async for event in stream]
    finally:
        await stream.aclose()


async def test_a_build_context_streams_up_and_its_events_come_back_in_order(
    node: TemplateNode,
) -> None:
    node.events = [
        BuildLog("step 1/2 run: echo \u00e9 \U0001f600"),
        BuildLog(""),
        BuildSucceeded(INFO),
    ]
    async with _remote(_app_transport(node)) as client:
        build_id, events = await _events(client, _context(("space.toml", SPEC), ("a/b", b"1")))
    assert build_id == "build-7f3a"
    assert events == node.events
    assert node.specs == ["py-data:v1"]
    assert (node.workdir / "ctx-1" / "a" / "b").read_bytes() == b"1"
    assert node.builds[0].closed


async def test_a_failed_build_ends_with_its_code_message_and_step(node: TemplateNode) -> None:
    node.events = [BuildLog("step 2/3 run"), BuildFailed("build_failed", "exit status 2", 1)]
    async with _remote(_app_transport(node)) as client:
        _, events = await _events(client, _context(("space.toml", SPEC)))
    assert events == node.events


async def test_a_node_error_mid_build_ends_the_stream_with_a_failed_event(
    node: TemplateNode,
) -> None:
    node.events = [BuildLog("step 1/3 packages")]
    node.stream_error = Unavailable("build VM died")
    async with _remote(_app_transport(node)) as client:
        _, events = await _events(client, _context(("space.toml", SPEC)))
    assert events == [BuildLog("step 1/3 packages"), BuildFailed("unavailable", "build VM died")]


async def test_negative_a_bad_context_is_invalid_argument_before_any_event(
    node: TemplateNode,
) -> None:
    bad = _context(("sub/space.toml", SPEC))
    async with _remote(_app_transport(node)) as client:
        with pytest.raises(InvalidArgument, match=r"space\.toml: missing at the archive's root"):
            await client.build_template(_chunks(bad))
    async with _http(node) as http:
        response = await http.post("/templates/builds", content=bad, headers=AUTH)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_argument"
    assert BUILD_ID_HEADER not in response.headers
    assert node.specs == [] and node.builds == []


async def test_negative_a_bad_spec_in_a_good_context_names_its_key(node: TemplateNode) -> None:
    spec = SPEC + b'packages = ["Bad Name"]\n'
    async with _remote(_app_transport(node)) as client:
        with pytest.raises(InvalidArgument, match=r"packages\[0\]"):
            await client.build_template(_chunks(_context(("space.toml", spec))))


async def test_templates_are_listed_with_every_field(node: TemplateNode) -> None:
    async with _remote(_app_transport(node)) as client:
        assert await client.list_templates() == [BASE, INFO]
    async with _http(node) as http:
        response = await http.get("/templates", headers=AUTH)
    assert response.json() == {"templates": [encode(BASE), encode(INFO)]}


@pytest.mark.parametrize("ref", ["py-data", "py-data:v1", f"py-data@{DIGEST}"])
async def test_delete_takes_a_name_a_tag_or_a_digest(node: TemplateNode, ref: str) -> None:
    async with _remote(_app_transport(node)) as client:
        await client.delete_template(ref)
    assert node.deleted == [ref]


@pytest.mark.parametrize("ref", ["py-data:v1", f"py-data@{DIGEST}"])
async def test_the_delete_route_takes_colons_and_at_signs_unencoded(
    node: TemplateNode, ref: str
) -> None:
    async with _http(node) as http:
        response = await http.delete(f"/templates/{ref}", headers=AUTH)
    assert response.status_code == 204, response.text
    assert node.deleted == [ref]


async def test_negative_deleting_an_unknown_template_or_base_fails_with_its_leaf(
    node: TemplateNode,
) -> None:
    async with _remote(_app_transport(node)) as client:
        with pytest.raises(NotFound, match="no template other:v2"):
            await client.delete_template("other:v2")
        with pytest.raises(Conflict, match="cannot be deleted"):
            await client.delete_template("base")
    assert node.deleted == []


@pytest.mark.parametrize("ref", ["", "..", "../sandboxes/sb-1", "Py", "py:v1@" + DIGEST, "a/b"])
async def test_negative_a_malformed_ref_is_refused_before_anything_is_sent(ref: str) -> None:
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(204)

    async with _remote(httpx.MockTransport(answer)) as client:
        with pytest.raises(InvalidArgument):
            await client.delete_template(ref)
    assert sent == []


# -- a hostile or broken node ---------------------------------------------------------


def _build_answer(body: bytes, headers: dict[str, str] | None = None) -> httpx.MockTransport:
    """A node answering every build with ``body`` as its NDJSON events."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={BUILD_ID_HEADER: "b-1"} | (headers or {}))

    return httpx.MockTransport(answer)


def _log(size: int) -> bytes:
    """A ``log`` line of exactly ``size`` bytes (newline excluded)."""
    overhead = len(json.dumps({"log": ""}, separators=(",", ":")))
    return json.dumps({"log": "x" * (size - overhead)}, separators=(",", ":")).encode()


_DONE = build_event_line(BuildSucceeded(INFO))


async def test_a_log_line_of_exactly_the_limit_is_accepted() -> None:
    async with _remote(_build_answer(_log(MAX_BUILD_LOG_BYTES) + b"\n" + _DONE)) as client:
        _, events = await _events(client, b"")
    assert len(events) == 2 and events[1] == BuildSucceeded(INFO)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (_log(MAX_BUILD_LOG_BYTES + 1) + b"\n" + _DONE, "a log line of 65537 bytes"),
        (b"x" * (MAX_LINE_BYTES + 1), "over-long NDJSON line"),
        (b"{not json\n" + _DONE, "malformed event"),
        (b'{"progress": 50}\n' + _DONE, "unknown build event 'progress'"),
        (b'{"log": "a", "failed": {}}\n', "one key"),
        (b'["log", "a"]\n', "one key"),
        (b'{"log": 5}\n', "must be a string"),
        (b'{"template": {"name": "x"}}\n', "malformed event"),
        (b'{"failed": {"code": "build_failed"}}\n', "malformed event"),
        (b'{"failed": {"code": "x", "message": "m", "step": "two"}}\n', "malformed event"),
        (build_event_line(BuildLog("step 1/2")), "ended without its result"),
        (b"", "ended without its result"),
    ],
)
async def test_negative_malformed_build_events_from_the_node_are_unavailable(
    body: bytes, match: str
) -> None:
    async with _remote(_build_answer(body)) as client:
        with pytest.raises(Unavailable, match=match):
            await _events(client, b"")


async def test_negative_a_build_answer_without_a_build_id_is_unavailable() -> None:
    async with _remote(_build_answer(_DONE, {BUILD_ID_HEADER: ""})) as client:
        with pytest.raises(Unavailable, match="X-Build-Id"):
            await client.build_template(_chunks(b""))


@pytest.mark.parametrize(
    "body",
    [
        [encode(INFO)],
        {"templates": encode(INFO)},
        {"templates": [encode(INFO) | {"cpus": "many"}]},
        {"templates": [{"name": "py-data"}]},
        {"items": []},
    ],
)
async def test_negative_a_malformed_template_list_is_unavailable(body: object) -> None:
    def answer(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=body)

    async with _remote(httpx.MockTransport(answer)) as client:
        with pytest.raises(Unavailable, match="malformed templates"):
            await client.list_templates()


async def test_a_well_formed_canned_list_parses_so_the_malformed_cases_can_fail() -> None:
    body = {"templates": [encode(INFO)]}

    def answer(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=body)

    async with _remote(httpx.MockTransport(answer)) as client:
        assert await client.list_templates() == [INFO]


# -- the wire format ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["x" * 200_000, "\u00e9" * 200_000, "\U0001f600" * 200_000, "\x01" * 90_000]
)
def test_the_node_cuts_a_long_log_line_to_what_clients_accept(text: str) -> None:
    line = build_event_line(BuildLog(text))
    assert len(line) <= MAX_BUILD_LOG_BYTES
    event = decode_build_event(line)
    assert isinstance(event, BuildLog) and event.line.endswith("characters cut]")
    assert text.startswith(event.line[:100])


def test_a_log_line_within_the_limit_is_sent_whole() -> None:
    text = "y" * (MAX_BUILD_LOG_BYTES - 20)
    assert decode_build_event(build_event_line(BuildLog(text))) == BuildLog(text)


async def test_closing_the_event_lines_early_closes_the_build_stream() -> None:
    stream = _FakeBuild([BuildLog("one"), BuildLog("two"), BuildSucceeded(INFO)])
    lines = build_lines(stream)
    assert await anext(lines) == build_event_line(BuildLog("one"))
    await lines.aclose()  # type: ignore[attr-defined]
    assert stream.closed


async def test_an_unexpected_error_mid_build_is_an_internal_failed_event() -> None:
    stream = _FakeBuild([], RuntimeError("boom"))
    lines = [line async for line in build_lines(stream)]
    assert [decode_build_event(line) for line in lines] == [
        BuildFailed("internal", "stream failed: RuntimeError")
    ]
    assert stream.closed


def test_a_node_error_is_a_build_failed_event_on_the_wire() -> None:
    error: NodeError = Conflict("template py-data:v1 is being built")
    line = build_event_line(BuildFailed(error.code, error.message))
    assert json.loads(line) == {
        "failed": {"code": "conflict", "message": error.message, "step": None}
    }
