"""Template specs: a full spec reads back, and every malformed one is refused by key path."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from space.node.api import InvalidArgument
from space.node.templates import (
    CopyStep,
    DebianBase,
    DigestBase,
    ReadyCheck,
    Resources,
    RunStep,
    TemplateBase,
    TemplateConfig,
    TemplateSpec,
    TemplateSpecError,
    load_spec,
    ready_from_record,
)
from space.node.templates.spec import MAX_SPEC_BYTES

DIGEST = "ab" * 32
MINIMAL = 'name = "t"\nbase = "debian:bookworm"\n'

FULL = """
name = "py-data"
tag = "v1"
base = "debian:bookworm"
packages = ["python3-numpy", "git"]
env = { LANG = "C.UTF-8", A_B = "x y" }
workdir = "/home/user/work"
start = "python3 -m http.server 8000"

[resources]
cpus = 1
memory_mib = 512
disk_mib = 4096

[[steps]]
copy = { src = "app/", dst = "/opt/app" }

[[steps]]
run = "pip install -r /opt/app/requirements.txt"

[[steps]]
run = "make"
user = "user"
"""


def q(text: str) -> str:
    """``text`` as a TOML basic string (JSON's escapes are a subset of TOML's)."""
    return json.dumps(text)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.toml"
    path.write_text(text)
    return path


def refused(tmp_path: Path, text: str) -> TemplateSpecError:
    path = write(tmp_path, text)
    with pytest.raises(TemplateSpecError) as caught:
        load_spec(path)
    assert caught.value.file == path
    return caught.value


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "requirements.txt").write_text("numpy\n")
    return tmp_path


def test_a_full_spec_reads_into_its_dataclasses(project: Path) -> None:
    spec = load_spec(write(project, FULL))
    assert spec == TemplateSpec(
        name="py-data",
        tag="v1",
        base=DebianBase("bookworm"),
        packages=("python3-numpy", "git"),
        steps=(
            CopyStep(src="app/", dst="/opt/app"),
            RunStep("pip install -r /opt/app/requirements.txt", user="root"),
            RunStep("make", user="user"),
        ),
        config=TemplateConfig(
            env=(("A_B", "x y"), ("LANG", "C.UTF-8")),
            workdir="/home/user/work",
            start="python3 -m http.server 8000",
            resources=Resources(cpus=1, memory_mib=512, disk_mib=4096),
        ),
    )


def test_optional_keys_take_their_defaults(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, MINIMAL))
    assert (spec.tag, spec.packages, spec.steps) == ("latest", (), ())
    assert spec.build_egress.closed
    assert spec.config == TemplateConfig(env=(), workdir=None, start=None, resources=Resources())


def test_build_egress_reads_as_an_egress_policy_in_its_canonical_form(tmp_path: Path) -> None:
    text = MINIMAL + (
        "[build_egress]\n"
        'allow = [{ domain = "*.pythonhosted.org", ports = [443] }, { cidr = "198.51.100.7" }]\n'
    )
    assert load_spec(write(tmp_path, text)).build_egress.to_json() == {
        "allow": [
            {"domain": "*.pythonhosted.org", "ports": [443]},
            {"cidr": "198.51.100.7/32", "ports": [80, 443]},
        ]
    }


@pytest.mark.parametrize(
    ("text", "base"),
    [
        ("debian:bookworm", DebianBase("bookworm")),
        ("template:py-data:v1", TemplateBase("py-data", "v1")),
        (f"template@{DIGEST}", DigestBase(DIGEST)),
    ],
)
def test_each_form_of_base_is_read(tmp_path: Path, text: str, base: object) -> None:
    spec = load_spec(write(tmp_path, f'name = "t"\nbase = {q(text)}\n'))
    assert spec.base == base
    assert str(spec.base) == text


def test_a_destination_is_normalised_without_dots_or_repeated_slashes(project: Path) -> None:
    text = MINIMAL + '[[steps]]\ncopy = { src = "app", dst = "//opt/./app/" }\n'
    assert load_spec(write(project, text)).steps == (CopyStep("app", "/opt/app"),)


def test_a_symlinked_source_inside_the_spec_directory_is_allowed(project: Path) -> None:
    (project / "link").symlink_to("app")
    text = MINIMAL + '[[steps]]\ncopy = { src = "link", dst = "/opt/app" }\n'
    assert load_spec(write(project, text)).steps == (CopyStep("link", "/opt/app"),)


def test_the_error_is_an_invalid_argument_and_a_value_error_naming_file_and_key(
    tmp_path: Path,
) -> None:
    error = refused(tmp_path, MINIMAL + "colour = 1\n")
    assert isinstance(error, InvalidArgument) and isinstance(error, ValueError)
    assert error.key == "colour"
    assert str(error).startswith(f"{tmp_path / 'space.toml'}: colour: unknown key")


# --- limits, each at its exact boundary ------------------------------------------------


def steps(count: int) -> str:
    return '[[steps]]\nrun = "true"\n' * count


def packages(count: int) -> str:
    return f"packages = [{', '.join(q(f'pkg{i}') for i in range(count))}]\n"


def env(count: int) -> str:
    entries = ", ".join(f"V{i} = {q('x')}" for i in range(count))
    return f"env = {{ {entries} }}\n"


def run(size: int) -> str:
    return f"[[steps]]\nrun = {q('x' * size)}\n"


def resources(name: str, value: int) -> str:
    return f"[resources]\n{name} = {value}\n"


AT_LIMIT = [
    MINIMAL + steps(64),
    MINIMAL + packages(256),
    MINIMAL + env(256),
    MINIMAL + run(16 * 1024),
    MINIMAL + f"start = {q('x' * 16 * 1024)}\n",
    f'name = "{"a" * 64}"\nbase = "debian:bookworm"\n',
    MINIMAL + f'tag = "{"a" * 64}"\n',
    MINIMAL + f"env = {{ A = {q('x' * 4096)} }}\n",
    *(
        MINIMAL + resources(name, value)
        for name, low, high in (
            ("cpus", 1, 8),
            ("memory_mib", 128, 16384),
            ("disk_mib", 1024, 65536),
        )
        for value in (low, high)
    ),
]

PAST_LIMIT = [
    (MINIMAL + steps(65), "steps", "at most 64"),
    (MINIMAL + packages(257), "packages", "at most 256"),
    (MINIMAL + env(257), "env", "at most 256"),
    (MINIMAL + run(16 * 1024 + 1), "steps[0].run", "at most 16384 bytes"),
    (MINIMAL + f"start = {q('x' * (16 * 1024 + 1))}\n", "start", "at most 16384 bytes"),
    (f'name = "{"a" * 65}"\nbase = "debian:bookworm"\n', "name", "at most 64"),
    (MINIMAL + f'tag = "{"a" * 65}"\n', "tag", "at most 64"),
    (MINIMAL + f"env = {{ A = {q('x' * 4097)} }}\n", "env.A", "at most 4096"),
    *(
        (MINIMAL + resources(name, value), f"resources.{name}", f"within {low}..{high}")
        for name, low, high in (
            ("cpus", 1, 8),
            ("memory_mib", 128, 16384),
            ("disk_mib", 1024, 65536),
        )
        for value in (low - 1, high + 1)
    ),
]


@pytest.mark.parametrize("text", AT_LIMIT)
def test_a_value_at_its_limit_is_accepted(tmp_path: Path, text: str) -> None:
    load_spec(write(tmp_path, text))


@pytest.mark.parametrize(("text", "key", "problem"), PAST_LIMIT, ids=[c[1] for c in PAST_LIMIT])
def test_negative_a_value_one_past_its_limit_is_refused_by_key(
    tmp_path: Path, text: str, key: str, problem: str
) -> None:
    error = refused(tmp_path, text)
    assert error.key == key
    assert problem in error.problem


def test_negative_a_multibyte_command_is_measured_in_bytes(tmp_path: Path) -> None:
    error = refused(tmp_path, MINIMAL + f"[[steps]]\nrun = {q('é' * 8193)}\n")
    assert (error.key, error.problem) == ("steps[0].run", "at most 16384 bytes, got 16386")


# --- malformed values ------------------------------------------------------------------

STEP = MINIMAL + "[[steps]]\n"
CP = "steps[0].copy"
EGRESS = MINIMAL + "[build_egress]\n"
RULE = MINIMAL + "[[build_egress.allow]]\n"

MALFORMED = [
    # unknown keys, at every level
    (MINIMAL + "colour = 1\n", "colour", "unknown key"),
    (MINIMAL + "[resources]\ngpus = 1\n", "resources.gpus", "unknown key"),
    (STEP + 'run = "x"\nshell = "bash"\n', "steps[0].shell", "unknown key"),
    (STEP + 'copy = { src = "app", dst = "/a", mode = 1 }\n', f"{CP}.mode", "unknown key"),
    # missing keys
    ('base = "debian:bookworm"\n', "name", "is required"),
    ('name = "t"\n', "base", "is required"),
    (STEP + 'copy = { src = "app" }\n', f"{CP}.dst", "is required"),
    (STEP + 'copy = { dst = "/a" }\n', f"{CP}.src", "is required"),
    # wrong types
    ('name = 1\nbase = "debian:bookworm"\n', "name", "must be a string, got an integer"),
    (MINIMAL + 'packages = "git"\n', "packages", "must be an array, got a string"),
    (MINIMAL + "packages = [1]\n", "packages[0]", "must be a string"),
    (MINIMAL + "env = { A = 1 }\n", "env.A", "must be a string"),
    (MINIMAL + 'env = ["A"]\n', "env", "must be a table"),
    (MINIMAL + "[resources]\ncpus = true\n", "resources.cpus", "must be an integer, got a boolean"),
    (MINIMAL + "[resources]\ncpus = 1.5\n", "resources.cpus", "must be an integer, got a float"),
    (MINIMAL + 'resources = "big"\n', "resources", "must be a table"),
    (MINIMAL + "[steps]\nrun = 1\n", "steps", "must be an array"),
    (MINIMAL + 'steps = ["true"]\n', "steps[0]", "must be a table"),
    (STEP + "run = 1\n", "steps[0].run", "must be a string"),
    (STEP + 'copy = "app"\n', "steps[0].copy", "must be a table"),
    (MINIMAL + "workdir = 1\n", "workdir", "must be a string"),
    # bad names and patterns
    ('name = "Py"\nbase = "debian:bookworm"\n', "name", "must match"),
    ('name = "-py"\nbase = "debian:bookworm"\n', "name", "must match"),
    (MINIMAL + 'tag = "v 1"\n', "tag", "must match"),
    (MINIMAL + 'packages = ["Git"]\n', "packages[0]", "must match"),
    (MINIMAL + 'packages = ["git; rm -rf /"]\n', "packages[0]", "must match"),
    (MINIMAL + 'packages = ["g"]\n', "packages[0]", "must match"),
    *[
        (MINIMAL + f"packages = [{q(name)}]\n", "packages[0]", "must match")
        for name in ("space-*", "space-?", "[a]pp", "^space", "a|b", "?name(x)", "~nx", "a,b")
    ],
    (MINIMAL + 'env = { "1A" = "x" }\n', "env['1A']", "must match"),
    (MINIMAL + 'env = { "A B" = "x" }\n', "env['A B']", "must match"),
    (MINIMAL + 'env = { A = "x\\u0000y" }\n', "env.A", "NUL"),
    (STEP + 'run = "x"\nuser = "Root"\n', "steps[0].user", "must match"),
    # bases
    ('name = "t"\nbase = "ubuntu:jammy"\n', "base", "is none of"),
    ('name = "t"\nbase = "debian:"\n', "base", "is none of"),
    ('name = "t"\nbase = "template:py-data"\n', "base", "is none of"),
    ('name = "t"\nbase = "template@abc"\n', "base", "is none of"),
    (f'name = "t"\nbase = "template@{DIGEST.upper()}"\n', "base", "is none of"),
    # steps
    (STEP, "steps[0]", "exactly one of"),
    (STEP + 'run = "x"\ncopy = { src = "app", dst = "/a" }\n', "steps[0]", "exactly one of"),
    (STEP + 'copy = { src = "app", dst = "/a" }\nuser = "u"\n', "steps[0].user", "run steps only"),
    (STEP + 'run = ""\n', "steps[0].run", "must not be empty"),
    (STEP + 'run = " \\n\\t"\n', "steps[0].run", "must not be empty"),
    (MINIMAL + 'start = ""\n', "start", "must not be empty"),
    # paths
    (STEP + 'copy = { src = "app", dst = "opt/app" }\n', f"{CP}.dst", "absolute"),
    (STEP + 'copy = { src = "app", dst = "/opt/../etc" }\n', f"{CP}.dst", "'..'"),
    (MINIMAL + 'workdir = "work"\n', "workdir", "absolute"),
    (STEP + 'copy = { src = "", dst = "/a" }\n', f"{CP}.src", "must not be empty"),
    (STEP + 'copy = { src = "/etc/passwd", dst = "/a" }\n', f"{CP}.src", "relative"),
    (STEP + 'copy = { src = "../secret", dst = "/a" }\n', f"{CP}.src", "'..'"),
    (STEP + 'copy = { src = "app/../app", dst = "/a" }\n', f"{CP}.src", "'..'"),
    (STEP + 'copy = { src = "missing", dst = "/a" }\n', f"{CP}.src", "does not exist"),
    # the build's egress policy
    (MINIMAL + 'build_egress = "pypi.org"\n', "build_egress", "must be a table"),
    (MINIMAL + "[build_egress]\ndeny = []\n", "build_egress.deny", "unknown key"),
    (EGRESS + 'allow = "pypi.org"\n', "build_egress.allow", "expected a list"),
    (EGRESS + 'allow = ["pypi.org"]\n', "build_egress.allow[0]", "expected an object"),
    (RULE + 'domain = "a..b"\n', "build_egress.allow[0].domain", "not a valid domain"),
    (RULE + 'domain = "pypi.org"\nports = [0]\n', "build_egress.allow[0].ports[0]", "not a port"),
    (RULE + 'cidr = "10.0.0.0/33"\n', "build_egress.allow[0].cidr", "not a network"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "key", "problem"), MALFORMED, ids=[c[1] for c in MALFORMED])
def test_negative_a_malformed_spec_is_refused_by_key(
    project: Path, text: str, key: str, problem: str
) -> None:
    error = refused(project, text)
    assert error.key == key
    assert problem in error.problem


def test_negative_the_key_path_counts_steps_from_zero(project: Path) -> None:
    text = MINIMAL + steps(2) + '[[steps]]\ncopy = { src = "../x", dst = "/a" }\n'
    assert refused(project, text).key == "steps[2].copy.src"


def test_negative_a_symlinked_source_leaving_the_spec_directory_is_refused(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "id_rsa").write_text("secret")
    spec_dir = tmp_path / "spec"
    spec_dir.mkdir()
    (spec_dir / "keys").symlink_to(outside)
    error = refused(spec_dir, MINIMAL + '[[steps]]\ncopy = { src = "keys", dst = "/a" }\n')
    assert error.key == "steps[0].copy.src"
    assert "outside the spec's directory" in error.problem


def test_negative_a_symlink_loop_as_source_is_refused(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to("loop")
    error = refused(tmp_path, MINIMAL + '[[steps]]\ncopy = { src = "loop", dst = "/a" }\n')
    assert error.key == "steps[0].copy.src"


# --- the file itself -------------------------------------------------------------------


def test_negative_invalid_toml_is_refused_with_its_position(tmp_path: Path) -> None:
    error = refused(tmp_path, 'name = "t\n')
    assert error.key == ""
    assert "not valid TOML" in error.problem and "line 1" in error.problem


def test_negative_a_missing_file_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(TemplateSpecError, match="cannot be read"):
        load_spec(tmp_path / "absent.toml")


def test_negative_a_file_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "space.toml"
    path.write_bytes(b'name = "\xff"\n')
    with pytest.raises(TemplateSpecError, match="not UTF-8"):
        load_spec(path)


def test_negative_a_spec_file_past_its_size_limit_is_refused(tmp_path: Path) -> None:
    padding = MAX_SPEC_BYTES - len(MINIMAL)
    path = write(tmp_path, MINIMAL + "#" * (padding - 1) + "\n")
    assert path.stat().st_size == MAX_SPEC_BYTES
    load_spec(path)
    with path.open("a") as stream:
        stream.write("\n")
    with pytest.raises(TemplateSpecError, match=f"larger than {MAX_SPEC_BYTES} bytes"):
        load_spec(path)


def test_negative_a_refused_spec_leaves_its_directory_unchanged(project: Path) -> None:
    path = write(project, MINIMAL + '[[steps]]\ncopy = { src = "../x", dst = "/a" }\n')
    before = sorted((p.relative_to(project), p.stat().st_mtime_ns) for p in project.rglob("*"))
    with pytest.raises(TemplateSpecError):
        load_spec(path)
    after = sorted((p.relative_to(project), p.stat().st_mtime_ns) for p in project.rglob("*"))
    assert after == before


# --- the ready check ---------------------------------------------------------------------

STARTED = MINIMAL + 'start = "python3 -m http.server 8000"\n'


def test_a_ready_check_reads_as_an_http_probe_or_a_command(tmp_path: Path) -> None:
    http = load_spec(
        write(tmp_path, STARTED + '[ready]\nhttp = { port = 8000, path = "/h?x=1" }\n')
    )
    assert http.config.ready == ReadyCheck(http_port=8000, http_path="/h?x=1", timeout_s=300)
    text = STARTED + '[ready]\ncommand = "test -e /tmp/up"\ntimeout_s = 1800\n'
    command = load_spec(write(tmp_path, text)).config.ready
    assert command == ReadyCheck(command="test -e /tmp/up", timeout_s=1800)
    assert load_spec(write(tmp_path, STARTED)).config.ready is None


def test_a_ready_check_record_reads_back_as_the_check_it_was(tmp_path: Path) -> None:
    for table in ('http = { port = 1, path = "/" }', 'command = "true"\ntimeout_s = 1'):
        check = load_spec(write(tmp_path, STARTED + f"[ready]\n{table}\n")).config.ready
        assert check is not None and ready_from_record(asdict(check)) == check


READY = STARTED + "[ready]\n"
HTTP = "ready.http"

READY_REFUSED = [
    (MINIMAL + '[ready]\ncommand = "true"\n', "ready", "needs a start command"),
    (READY, "ready", "exactly one of 'command' or 'http'"),
    (READY + 'command = "true"\nhttp = { port = 1, path = "/" }\n', "ready", "exactly one of"),
    (READY + 'command = "true"\nevery_s = 1\n', "ready.every_s", "unknown key"),
    (READY + 'command = " "\n', "ready.command", "must not be empty"),
    (READY + f"command = {q('x' * (16 * 1024 + 1))}\n", "ready.command", "at most 16384 bytes"),
    (READY + 'command = "true"\ntimeout_s = 0\n', "ready.timeout_s", "within 1..1800, got 0"),
    (READY + 'command = "true"\ntimeout_s = 1801\n', "ready.timeout_s", "within 1..1800"),
    (READY + 'command = "true"\ntimeout_s = 1.5\n', "ready.timeout_s", "must be an integer"),
    (READY + 'http = "http://127.0.0.1/"\n', HTTP, "must be a table"),
    (READY + 'http = { path = "/" }\n', f"{HTTP}.port", "is required"),
    (READY + "http = { port = 80 }\n", f"{HTTP}.path", "is required"),
    (READY + 'http = { port = 0, path = "/" }\n', f"{HTTP}.port", "within 1..65535, got 0"),
    (READY + 'http = { port = 65536, path = "/" }\n', f"{HTTP}.port", "within 1..65535"),
    (READY + 'http = { port = 80, path = "health" }\n', f"{HTTP}.path", "must match"),
    (READY + 'http = { port = 80, path = "/a b" }\n', f"{HTTP}.path", "must match"),
    (READY + f"http = {{ port = 80, path = {q('/' * 1025)} }}\n", f"{HTTP}.path", "at most 1024"),
    (READY + 'http = { port = 80, path = "/", host = "10.0.0.1" }\n', f"{HTTP}.host", "unknown"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "key", "problem"), READY_REFUSED, ids=[c[2][:24] for c in READY_REFUSED]
)
def test_negative_a_malformed_ready_check_is_refused_by_key(
    tmp_path: Path, text: str, key: str, problem: str
) -> None:
    error = refused(tmp_path, text)
    assert (error.key, problem in error.problem) == (key, True), error.problem


def test_negative_a_hostile_ready_check_record_is_refused_as_an_invalid_argument() -> None:
    for record in (
        {"command": None, "http_port": 99999, "http_path": "/", "timeout_s": 1},
        {"command": "true", "http_port": 80, "http_path": "/", "timeout_s": 1},
        {"command": "true", "http_port": None, "http_path": None, "timeout_s": 10**9},
        {"command": "true", "extra": 1},
        "true",
    ):
        with pytest.raises(InvalidArgument):
            ready_from_record(record)
