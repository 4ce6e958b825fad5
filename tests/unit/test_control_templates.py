"""``/v1/templates`` over a FakeNode: build stream, list, delete, tenancy, limits."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.control.routers import templates as template_routes
from space.control.template_names import MAX_TENANT_NAME_CHARS, node_name, tenant_prefix
from space.control.template_spec import rewrite_spec
from tests.unit._fake_templates import BASE_DIGEST
from tests.unit.fakes import FakeNode, Harness, control_app

pytestmark = pytest.mark.anyio

SPEC = 'name = "py"\ntag = "v1"\nbase = "debian:bookworm"\n[[steps]]\nrun = "true"\n'


def archive(spec: str | None = SPEC, files: dict[str, bytes] | None = None, **extra: Any) -> bytes:
    """A gzip'd build context: ``space.toml`` (unless None) and ``files``."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        entries = {**({"space.toml": spec.encode()} if spec is not None else {}), **(files or {})}
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, info in extra.items():
            del name
            tar.addfile(info)
    # No timestamp: the same bytes, so the same test ids, in every xdist worker.
    return gzip.compress(raw.getvalue(), mtime=0)


async def build(h: Harness, key: dict[str, str], body: bytes) -> httpx.Response:
    return await h.client.post("/v1/templates", content=body, headers=key)


def lines(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


async def listed(h: Harness, key: dict[str, str]) -> list[dict[str, Any]]:
    response = await h.client.get("/v1/templates", headers=key)
    assert response.status_code == 200, response.text
    templates: list[dict[str, Any]] = response.json()["templates"]
    return templates


def spec(name: str = "py", tag: str = "v1", base: str = "debian:bookworm") -> str:
    return f'name = "{name}"\ntag = "{tag}"\nbase = "{base}"\n'


async def test_a_build_streams_its_log_then_the_template_in_the_tenants_names(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        events = lines(await build(h, key, archive(files={"app/x.py": b"print(1)"})))
        assert [e["type"] for e in events] == ["log", "log", "template"]
        assert events[0]["line"] == "step 1/2 run: building py:v1"  # no node prefix shown
        template = events[-1]["template"]
        assert (template["name"], template["tag"], template["base"]) == (
            "py", "v1", "debian:bookworm",
        )  # fmt: skip
        assert (tenant_prefix("acme") + "py", "v1") in h.node.templates
        received = h.node.contexts[-1]
        assert received["app/x.py"] == b"print(1)"
        assert received["space.toml"] is not None
        assert tomllib.loads(received["space.toml"].decode())["steps"] == [{"run": "true"}]


async def test_a_failed_build_ends_with_an_error_line_naming_the_step(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        events = lines(await build(h, key, archive(SPEC.replace("true", "fail"))))
        assert events[-1] == {
            "type": "error", "code": "build_failed", "message": "py: step failed", "step": 1,
        }  # fmt: skip
        assert [t["name"] for t in await listed(h, key)] == ["base"]


async def test_the_list_holds_base_and_the_tenants_templates_sorted(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        for name, tag in (("zz", "latest"), ("py", "v2"), ("py", "v1")):
            lines(await build(h, key, archive(spec(name, tag))))
        names = [(t["name"], t["tag"]) for t in await listed(h, key)]
        assert names == [("base", "latest"), ("py", "v1"), ("py", "v2"), ("zz", "latest")]
        base = (await listed(h, key))[0]
        assert base["digest"] == BASE_DIGEST and base["created_at"].endswith("+00:00")


async def test_a_template_based_on_another_shows_the_base_in_the_tenants_names(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        lines(await build(h, key, archive()))
        events = lines(await build(h, key, archive(spec("app", base="template:py:v1"))))
        assert events[-1]["template"]["base"] == "template:py:v1"


async def test_delete_removes_a_tag_then_answers_404(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        lines(await build(h, key, archive()))
        assert (await h.client.delete("/v1/templates/py:v1", headers=key)).status_code == 204
        assert [t["name"] for t in await listed(h, key)] == ["base"]
        again = await h.client.delete("/v1/templates/py:v1", headers=key)
        assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"


async def test_delete_by_digest_removes_every_tag_of_that_build(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        digest = lines(await build(h, key, archive()))[-1]["template"]["digest"]
        lines(await build(h, key, archive(SPEC.replace("v1", "latest"))))
        answer = await h.client.delete(f"/v1/templates/py@{digest}", headers=key)
        assert answer.status_code == 204
        assert [t["name"] for t in await listed(h, key)] == ["base"]


async def test_negative_base_cannot_be_deleted_or_rebuilt(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        answer = await h.client.delete("/v1/templates/base", headers=key)
        assert answer.status_code == 409
        rebuilt = await build(h, key, archive(spec("base", "latest")))
        assert rebuilt.status_code == 409 and "read-only" in rebuilt.json()["error"]["message"]
        assert h.node.contexts == []


@pytest.mark.parametrize("ref", ["Py", "py:", "py@abc", "py:v1@" + "0" * 64, "a" * 65])
async def test_negative_a_malformed_reference_to_delete_is_422(tmp_path: Path, ref: str) -> None:
    async with control_app(tmp_path) as h:
        answer = await h.client.delete(f"/v1/templates/{ref}", headers=h.key("acme"))
        assert answer.status_code == 422


async def test_tenant_b_cannot_see_use_delete_or_build_on_tenant_as_template(
    tmp_path: Path,
) -> None:
    async with control_app(tmp_path) as h:
        a, b = h.key("tenant-a"), h.key("tenant-b")
        digest = lines(await build(h, a, archive()))[-1]["template"]["digest"]
        assert [t["name"] for t in await listed(h, b)] == ["base"]
        used = await h.client.post("/v1/sandboxes", json={"template": "py:v1"}, headers=b)
        assert used.status_code == 404
        by_digest = {"template": f"py@{digest}"}
        assert (await h.client.post("/v1/sandboxes", json=by_digest, headers=b)).status_code == 404
        assert (await h.client.delete("/v1/templates/py:v1", headers=b)).status_code == 404
        for base in ("template:py:v1", f"template@{digest}"):
            on_it = await build(h, b, archive(spec("mine", base=base)))
            assert on_it.status_code == 404, base
        assert (tenant_prefix("tenant-a") + "py", "v1") in h.node.templates


async def test_every_tenant_can_use_base_and_its_own_template(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        a, b = h.key("tenant-a"), h.key("tenant-b")
        digest = lines(await build(h, a, archive()))[-1]["template"]["digest"]
        for ref in ("py:v1", f"py@{digest}"):
            made = await h.client.post("/v1/sandboxes", json={"template": ref}, headers=a)
            assert made.status_code == 201 and made.json()["template"] == ref
            node_template = h.node.boxes[made.json()["id"]].status.template
            assert node_template.startswith(tenant_prefix("tenant-a"))
        for key in (a, b):
            made = await h.client.post("/v1/sandboxes", json={"template": "base"}, headers=key)
            assert made.status_code == 201
        on_base = lines(await build(h, b, archive(spec("mine", base=f"template@{BASE_DIGEST}"))))
        assert on_base[-1]["type"] == "template"


async def test_the_upload_is_capped_at_the_limit_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = archive()
    async with control_app(tmp_path) as h:
        key = h.key("acme")
        monkeypatch.setattr(template_routes, "MAX_UPLOAD_BYTES", len(body))
        assert lines(await build(h, key, body))[-1]["type"] == "template"
        monkeypatch.setattr(template_routes, "MAX_UPLOAD_BYTES", len(body) - 1)
        declared = await build(h, key, body)
        assert declared.status_code == 429
        assert declared.json()["error"]["details"]["limit_bytes"] == len(body) - 1

        async def chunked() -> AsyncIterator[bytes]:
            yield body  # no Content-Length: the cap is counted as bytes arrive

        streamed = await h.client.post("/v1/templates", content=chunked(), headers=key)
        assert streamed.status_code == 429
        assert len(h.node.contexts) == 1


def _symlink() -> tarfile.TarInfo:
    info = tarfile.TarInfo("link")
    info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    return info


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"not an archive", "not a tar archive"),
        (archive(None, {"x": b"1"}), "no space.toml"),
        (archive(files={"./space.toml": SPEC.encode()}), "two entries"),
        (archive(files={"a/../../x": b"1"}), "'..'"),
        (archive(files={"/etc/x": b"1"}), "relative"),
        (archive(link=_symlink()), "only regular files and directories"),
        (archive('name = "py"\nbase = '), "not valid TOML"),
        (archive('base = "debian:bookworm"\n'), "name"),
        (archive(spec("x" * (MAX_TENANT_NAME_CHARS + 1))), f"at most {MAX_TENANT_NAME_CHARS}"),
        (archive(spec(base="template:Py:v1")), "base"),
    ],
)
async def test_negative_a_bad_context_is_422_before_any_build(
    tmp_path: Path, body: bytes, words: str
) -> None:
    async with control_app(tmp_path) as h:
        answer = await build(h, h.key("acme"), body)
        assert answer.status_code == 422, answer.text
        assert words in answer.json()["error"]["message"]
        assert h.node.contexts == []


async def test_a_name_of_exactly_the_longest_length_builds(tmp_path: Path) -> None:
    async with control_app(tmp_path) as h:
        name = "x" * MAX_TENANT_NAME_CHARS
        events = lines(await build(h, h.key("acme"), archive(spec(name))))
        assert events[-1]["template"]["name"] == name


async def test_a_build_runs_on_every_node_and_lines_name_the_node(tmp_path: Path) -> None:
    from space.control import NodeRegistry

    first, second = FakeNode("n1"), FakeNode("n2")
    registry = NodeRegistry()
    registry.register("n1", first)
    registry.register("n2", second)
    async with control_app(tmp_path, first, registry=registry) as h:
        events = lines(await build(h, h.key("acme"), archive()))
        assert {e["line"].split()[0] for e in events if e["type"] == "log"} == {"[n1]", "[n2]"}
        assert events[-1]["type"] == "template"
        assert len(first.contexts) == len(second.contexts) == 1
        assert [t["name"] for t in await listed(h, h.key("acme"))] == ["base", "py"]


#: A spec with every field, strings that need escapes, nested tables and arrays of them.
FULL_SPEC = r'''
name = "py"
tag = "v1"
base = "template:py:v0"
packages = ["python3-numpy", "git"]
env = { LANG = "C.UTF-8", "ODD KEY" = "say \"hi\"\\n", TAB = "a\tb", CTRL = "\u0001\u007f é\r\n" }
workdir = "/home/user/work"
start = 'python3 -c "print(1)"'  # a literal string
[resources]
cpus = 2
memory_mib = 512
disk_mib = 2048
[build_egress]
allow = [{ domain = "pypi.org" }, { domain = "*.example.com", ports = [443, 8443] }]
[[steps]]
copy = { src = "app/", dst = "/opt/app" }
[[steps]]
run = """pip install \\
  -r /opt/app/requirements.txt"""
user = "root"
'''

#: Every other TOML value: numbers, dates and times, mixed and nested arrays.
VALUES_SPEC = (
    'name = "py"\na = "q\\"\\\\\\u0001\\u007f é\\n"\nb = 1\nc = 1.5\nd = true\n'
    "e = 1979-05-27T07:32:00Z\nl = 1979-05-27T07:32:00\nday = 2020-01-01\nnoon = 12:00:00\n"
    'f = [1, "x", {g = [], h = {}}, [[]]]\n[t]\n"k y" = -inf\n[t.u.v]\nw = 0x10\n'
    "[[s]]\nr = 2020-01-01\n[[s]]\n[s.x]\n"
)


@pytest.mark.parametrize("text", [FULL_SPEC, VALUES_SPEC], ids=["every-field", "every-value"])
def test_a_rewritten_spec_reads_back_the_same_but_for_its_names(text: str) -> None:
    document = tomllib.loads(text)
    written = tomllib.loads(rewrite_spec(text.encode(), "acme", set()).decode())
    assert written["name"] == node_name("acme", "py")
    if "base" in document:
        assert written["base"] == f"template:{node_name('acme', 'py')}:v0"
        document["base"] = written["base"]
    assert written == {**document, "name": written["name"]}


async def test_a_sandbox_takes_the_resources_it_leaves_out_from_its_template(
    tmp_path: Path,
) -> None:
    sized = spec() + "[resources]\ncpus = 2\nmemory_mib = 512\n"
    async with control_app(tmp_path) as h:
        a = h.key("tenant-a")
        assert lines(await build(h, a, archive(sized)))[-1]["type"] == "template"
        made = await h.client.post("/v1/sandboxes", json={"template": "py:v1"}, headers=a)
        assert made.status_code == 201, made.text
        assert (made.json()["cpus"], made.json()["memory_mib"]) == (2, 512)
        body = {"template": "py:v1", "memory_mib": 1024}
        made = await h.client.post("/v1/sandboxes", json=body, headers=a)
        assert (made.json()["cpus"], made.json()["memory_mib"]) == (2, 1024)
        made = await h.client.post("/v1/sandboxes", json={}, headers=a)
        assert (made.json()["cpus"], made.json()["memory_mib"]) == (1, 256)
