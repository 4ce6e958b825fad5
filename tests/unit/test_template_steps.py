"""Build plans: step order, resolved copies, and digests that change from the changed step on."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import space.node.templates as templates
from space.node.templates import (
    CopyPlan,
    Packages,
    RunStep,
    Step,
    TemplateConfig,
    TemplateSpecError,
    _tree,
    describe,
    load_spec,
    plan,
    template_digest,
)

BASE = "0f" * 32
SPEC = """
name = "py-data"
base = "debian:bookworm"
packages = ["python3-numpy", "git", "git"]
env = { LANG = "C.UTF-8", TZ = "UTC" }
workdir = "/work"
start = "python3 -m http.server 8000"
[resources]
cpus = 2

[[steps]]
copy = { src = "app", dst = "/opt/app" }
[[steps]]
run = "pip install -r /opt/app/requirements.txt"
[[steps]]
copy = { src = "app/run.sh", dst = "/usr/local/bin/run" }
[[steps]]
run = "make -C /opt/app"
user = "user"
"""
#: Plan positions of the spec above.
PACKAGES, COPY, PIP, COPY_FILE, MAKE, CONFIG = range(6)


def make_project(root: Path, spec: str = SPEC) -> Path:
    """A spec directory holding ``spec`` and the app it copies; the spec's path."""
    app = root / "app"
    (app / "lib").mkdir(parents=True)
    (app / "requirements.txt").write_text("numpy\n")
    (app / "lib" / "data.bin").write_bytes(bytes(range(256)) * 10)
    (app / "run.sh").write_text("#!/bin/sh\nexec python3 -m app\n")
    (app / "run.sh").chmod(0o755)
    (root / "space.toml").write_text(spec)
    return root / "space.toml"


def plan_of(path: Path, base: str = BASE) -> list[Step]:
    return plan(load_spec(path), path.parent, base)


def digests(steps: list[Step]) -> list[str]:
    return [step.digest for step in steps]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return make_project(tmp_path / "project")


def test_the_plan_is_packages_then_each_step_in_order_then_config(project: Path) -> None:
    steps = plan_of(project)
    assert [(s.index, s.kind, s.key) for s in steps] == [
        (0, "packages", "packages"),
        (1, "copy", "steps[0]"),
        (2, "run", "steps[1]"),
        (3, "copy", "steps[2]"),
        (4, "run", "steps[3]"),
        (5, "config", "config"),
    ]
    assert steps[PACKAGES].action == Packages(("git", "python3-numpy"))
    assert steps[MAKE].action == RunStep("make -C /opt/app", user="user")
    config = steps[CONFIG].action
    assert isinstance(config, TemplateConfig)
    assert config.env == (("LANG", "C.UTF-8"), ("TZ", "UTC"))


def test_each_step_chains_to_the_previous_digest_and_the_template_is_the_last(
    project: Path,
) -> None:
    steps = plan_of(project)
    assert [s.parent for s in steps] == [BASE, *digests(steps)[:-1]]
    assert len(set(digests(steps))) == len(steps)
    assert template_digest(steps) == steps[-1].digest
    assert all(len(d) == 64 and int(d, 16) >= 0 for d in digests(steps))


def test_a_spec_without_packages_or_steps_plans_only_its_config(tmp_path: Path) -> None:
    (tmp_path / "space.toml").write_text('name = "t"\nbase = "debian:bookworm"\n')
    steps = plan_of(tmp_path / "space.toml")
    assert [s.kind for s in steps] == ["config"]


def test_a_copy_lists_directories_before_their_files_with_mode_and_hash(project: Path) -> None:
    action = plan_of(project)[COPY].action
    assert isinstance(action, CopyPlan)
    app = (project.parent / "app").resolve()
    assert [(e.path, e.kind) for e in action.files] == [
        (".", "dir"),
        ("lib", "dir"),
        ("lib/data.bin", "file"),
        ("requirements.txt", "file"),
        ("run.sh", "file"),
    ]
    run_sh = action.files[-1]
    assert run_sh.source == app / "run.sh"
    assert (run_sh.mode, run_sh.size) == (0o755, len(b"#!/bin/sh\nexec python3 -m app\n"))
    assert run_sh.sha256 == hashlib.sha256((app / "run.sh").read_bytes()).hexdigest()
    assert run_sh.target("/opt/app") == "/opt/app/run.sh"
    assert action.files[0].target("/opt/app") == "/opt/app"


def test_a_single_file_copy_lists_just_that_file(project: Path) -> None:
    action = plan_of(project)[COPY_FILE].action
    assert isinstance(action, CopyPlan)
    assert [(e.path, e.kind, e.mode) for e in action.files] == [(".", "file", 0o755)]
    assert action.files[0].target(action.dst) == "/usr/local/bin/run"


def test_files_are_hashed_in_chunks_to_the_same_digest(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = plan_of(project)
    monkeypatch.setattr(_tree, "CHUNK_BYTES", 7)
    assert digests(plan_of(project)) == digests(whole)


def test_describe_gives_one_line_per_step_for_build_logs(project: Path) -> None:
    steps = plan_of(project)
    lines = describe(steps)
    assert len(lines) == len(steps)
    assert lines[PACKAGES] == (
        f"step 1/6 packages {steps[0].digest[:12]}: install 2 packages: git python3-numpy"
    )
    assert lines[COPY].endswith("copy app -> /opt/app (3 files, 2596 bytes)")
    assert lines[MAKE].endswith("run as user: make -C /opt/app")
    assert lines[CONFIG].endswith(
        "config: env 2 variables, workdir /work, start python3 -m http.server 8000, cpus 2"
    )


# --- stability --------------------------------------------------------------------------


def test_the_same_inputs_give_the_same_digests_wherever_the_project_lives(
    tmp_path: Path,
) -> None:
    first = plan_of(make_project(tmp_path / "a"))
    second = plan_of(make_project(tmp_path / "b"))
    assert digests(first) == digests(second)


def test_digests_ignore_the_order_of_env_packages_and_duplicates(tmp_path: Path) -> None:
    reordered = SPEC.replace('["python3-numpy", "git", "git"]', '["git", "python3-numpy"]').replace(
        '{ LANG = "C.UTF-8", TZ = "UTC" }', '{ TZ = "UTC", LANG = "C.UTF-8" }'
    )
    assert reordered != SPEC
    first = plan_of(make_project(tmp_path / "a"))
    second = plan_of(make_project(tmp_path / "b", reordered))
    assert digests(first) == digests(second)


def test_digests_ignore_the_order_files_were_created_in(tmp_path: Path) -> None:
    names = [f"f{i:02d}" for i in range(20)]
    for root, order in ((tmp_path / "a", names), (tmp_path / "b", names[::-1])):
        make_project(root)
        for name in order:
            (root / "app" / name).write_text(name)
    assert digests(plan_of(tmp_path / "a" / "space.toml")) == digests(
        plan_of(tmp_path / "b" / "space.toml")
    )


def test_renaming_a_copy_source_keeps_its_digest(project: Path) -> None:
    before = plan_of(project)
    (project.parent / "app").rename(project.parent / "src")
    project.write_text(SPEC.replace('"app', '"src'))
    assert digests(plan_of(project)) == digests(before)


# --- changing step k changes digests k.. and nothing before ------------------------------

Change = Callable[[Path], None]


def edit_spec(old: str, new: str) -> Change:
    def change(path: Path) -> None:
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new))

    return change


def flip_byte(path: Path) -> None:
    data = bytearray((path.parent / "app" / "lib" / "data.bin").read_bytes())
    data[1000] ^= 1
    (path.parent / "app" / "lib" / "data.bin").write_bytes(data)


def chmod_file(path: Path) -> None:
    (path.parent / "app" / "requirements.txt").chmod(0o600)


def add_file(path: Path) -> None:
    (path.parent / "app" / "lib" / "new.txt").write_text("")


def add_dir(path: Path) -> None:
    (path.parent / "app" / "empty").mkdir()


def chmod_run_sh(path: Path) -> None:
    (path.parent / "app" / "run.sh").chmod(0o700)


CHANGES = {
    "a package": (edit_spec('"git", "git"', '"git", "curl"'), PACKAGES),
    "a byte of a copied file": (flip_byte, COPY),
    "a copied file's mode": (chmod_file, COPY),
    "a new file in a copied directory": (add_file, COPY),
    "a new empty directory": (add_dir, COPY),
    "a copy destination": (edit_spec('dst = "/opt/app"', 'dst = "/srv/app"'), COPY),
    "a run command": (edit_spec("pip install", "pip3 install"), PIP),
    "the mode of a file copied twice": (chmod_run_sh, COPY),
    "a run step's user": (edit_spec('user = "user"', 'user = "root"'), MAKE),
    "an env value": (edit_spec('TZ = "UTC"', 'TZ = "CET"'), CONFIG),
    "the workdir": (edit_spec('workdir = "/work"', 'workdir = "/srv"'), CONFIG),
    "the start command": (edit_spec("8000", "8001"), CONFIG),
    "a resource": (edit_spec("cpus = 2", "cpus = 3"), CONFIG),
    "a ready check": (edit_spec("cpus = 2\n", 'cpus = 2\n[ready]\ncommand = "true"\n'), CONFIG),
}


def test_every_field_of_a_ready_check_is_part_of_the_config_digest(project: Path) -> None:
    spec = project  # the spec file's path
    seen = set()
    for ready in (
        'command = "true"',
        'command = "true"\ntimeout_s = 10',
        'http = { port = 8000, path = "/" }',
        'http = { port = 8001, path = "/" }',
        'http = { port = 8000, path = "/health" }',
    ):
        spec.write_text(SPEC.replace("cpus = 2\n", f"cpus = 2\n[ready]\n{ready}\n"))
        steps = plan_of(spec)
        seen.add(steps[CONFIG].digest)
        assert "ready " in describe(steps)[CONFIG]
    assert len(seen) == 5


@pytest.mark.parametrize(("change", "first_changed"), CHANGES.values(), ids=CHANGES.keys())
def test_changing_step_k_changes_its_digest_and_every_later_one_only(
    project: Path, change: Change, first_changed: int
) -> None:
    before = digests(plan_of(project))
    change(project)
    after = digests(plan_of(project))
    assert after[:first_changed] == before[:first_changed]
    assert all(a != b for a, b in zip(after[first_changed:], before[first_changed:], strict=True))


def test_changing_the_base_changes_every_digest(project: Path) -> None:
    before = plan_of(project)
    after = plan_of(project, base="1f" * 32)
    assert all(a != b for a, b in zip(digests(after), digests(before), strict=True))


def test_a_spec_name_and_tag_are_not_part_of_any_digest(project: Path) -> None:
    before = digests(plan_of(project))
    project.write_text(SPEC.replace('name = "py-data"', 'name = "other"\ntag = "v2"'))
    assert digests(plan_of(project)) == before


# --- symlinks and limits ----------------------------------------------------------------


def test_a_symlink_inside_the_spec_directory_is_followed(project: Path) -> None:
    app = project.parent / "app"
    (app / "again.sh").symlink_to("run.sh")
    (app / "lib2").symlink_to("lib")
    action = plan_of(project)[COPY].action
    assert isinstance(action, CopyPlan)
    entries = {e.path: e for e in action.files}
    assert entries["again.sh"].sha256 == entries["run.sh"].sha256
    assert entries["again.sh"].source == (app / "run.sh").resolve()
    assert entries["lib2/data.bin"].kind == "file"


def test_negative_a_symlink_in_a_copied_directory_leaving_the_spec_directory_is_refused(
    tmp_path: Path,
) -> None:
    project = make_project(tmp_path / "project")
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    (project.parent / "app" / "lib" / "key").symlink_to(secret)
    with pytest.raises(TemplateSpecError) as caught:
        plan(load_spec(project), project.parent, BASE)
    assert caught.value.key == "steps[0].copy.src"
    assert "'lib/key' is a symlink to" in caught.value.problem
    assert "outside the spec's directory" in caught.value.problem


def test_negative_a_source_swapped_for_an_escaping_symlink_after_loading_is_refused(
    tmp_path: Path,
) -> None:
    project = make_project(tmp_path / "project")
    spec = load_spec(project)
    shutil.rmtree(project.parent / "app")
    (project.parent / "app").symlink_to(tmp_path)
    with pytest.raises(TemplateSpecError, match="outside the spec's directory") as caught:
        plan(spec, project.parent, BASE)
    assert caught.value.key == "steps[0].copy.src"


def test_negative_a_symlink_cycle_in_a_copied_directory_is_refused(project: Path) -> None:
    (project.parent / "app" / "lib" / "up").symlink_to("..")
    with pytest.raises(TemplateSpecError, match="'lib/up' is a symlink cycle"):
        plan_of(project)


def test_negative_a_fifo_in_a_copied_directory_is_refused(project: Path) -> None:
    os.mkfifo(project.parent / "app" / "pipe")
    with pytest.raises(TemplateSpecError, match="'pipe' is not a regular file or directory"):
        plan_of(project)


def test_negative_a_copy_past_its_entry_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "space.toml").write_text(
        'name = "t"\nbase = "debian:bookworm"\n[[steps]]\ncopy = { src = "d", dst = "/d" }\n'
    )
    (tmp_path / "d").mkdir()
    monkeypatch.setattr(_tree, "MAX_COPY_ENTRIES", 3)
    for name in ("a", "b"):
        (tmp_path / "d" / name).write_text(name)
    plan_of(tmp_path / "space.toml")  # the directory and two files: at the limit
    (tmp_path / "d" / "c").write_text("c")
    with pytest.raises(TemplateSpecError, match="more than 3 files and directories"):
        plan_of(tmp_path / "space.toml")


def test_negative_a_file_cannot_be_copied_to_the_root(project: Path) -> None:
    project.write_text(SPEC.replace('dst = "/usr/local/bin/run"', 'dst = "/"'))
    with pytest.raises(TemplateSpecError) as caught:
        plan_of(project)
    assert caught.value.key == "steps[2].copy.dst"


@pytest.mark.parametrize("base", ["", "0f" * 31, "0F" * 32, "0f" * 32 + "\n", "xyz"])
def test_negative_a_malformed_base_digest_is_refused(project: Path, base: str) -> None:
    with pytest.raises(TemplateSpecError) as caught:
        plan_of(project, base=base)
    assert caught.value.key == "base"


def test_the_package_exports_exactly_the_pinned_names() -> None:
    assert set(templates.__all__) == {
        "Base", "CopyEntry", "CopyPlan", "CopyStep", "DebianBase", "DigestBase", "Packages",
        "ReadyCheck", "Resources", "RunStep", "Step", "TemplateBase", "TemplateConfig",
        "TemplateError", "TemplateRef", "TemplateRefError", "TemplateSpec", "TemplateSpecError",
        "describe", "load_spec", "parse_ref", "parse_spec", "plan", "ready_from_record",
        "template_digest", "unpack_context",
    }  # fmt: skip
    assert all(hasattr(templates, name) for name in templates.__all__)
