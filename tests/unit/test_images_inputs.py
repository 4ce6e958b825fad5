"""Template inputs: the digest is stable, and any change to an input changes it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import space.node.images as images
from space.node.api import NodeError, NotFound
from space.node.images import ImageBuildError, TemplateNotFound, template_digest
from space.node.images._kernel import KernelPackage
from space.node.images._rootfs import (
    DEFAULT_MIRROR,
    Debootstrap,
    GuestSource,
    apt_mirror,
    guest_sources,
    parse_mirror,
)
from space.node.images._template import TemplateInputs


def _inputs(**changes: object) -> TemplateInputs:
    base = TemplateInputs(
        name="base",
        kernel=KernelPackage("linux-image-6.1.0-57-cloud-amd64", "6.1.192-3", "aa" * 32),
        busybox_sha256="bb" * 32,
        debootstrap=Debootstrap(mirror="http://mirror.test/debian"),
        sources=(GuestSource("__init__.py", b""), GuestSource("guest/init.py", b"print(1)\n")),
        assets_sha256={"space-init.sh": "cc" * 32},
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_public_names_are_pinned() -> None:
    assert sorted(images.__all__) == [
        "DEFAULT_CACHE_DIR",
        "GuestImage",
        "ImageBuildError",
        "TemplateNotFound",
        "build_template",
        "template_digest",
    ]
    assert issubclass(ImageBuildError, NodeError)
    assert issubclass(TemplateNotFound, NotFound)
    assert issubclass(TemplateNotFound, ImageBuildError)


def test_digest_is_stable_hex_sha256() -> None:
    digest = _inputs().digest()
    assert digest == _inputs().digest()
    assert len(digest) == 64
    int(digest, 16)


@pytest.mark.parametrize(
    "changes",
    [
        {"kernel": KernelPackage("linux-image-6.1.0-57-cloud-amd64", "6.1.192-4", "aa" * 32)},
        {"kernel": KernelPackage("linux-image-6.1.0-57-cloud-amd64", "6.1.192-3", "ab" * 32)},
        {"busybox_sha256": "bc" * 32},
        {"debootstrap": Debootstrap(mirror="http://other.test/debian")},
        {"debootstrap": Debootstrap(mirror="http://mirror.test/debian", include=("python3",))},
        {"sources": (GuestSource("__init__.py", b""), GuestSource("guest/init.py", b"print(2)\n"))},
        {"sources": (GuestSource("__init__.py", b""), GuestSource("guest/main.py", b"print(1)\n"))},
        {"sources": (GuestSource("__init__.py", b""),)},
        {"assets_sha256": {"space-init.sh": "cd" * 32}},
        {"name": "other"},
    ],
)
def test_changing_any_input_changes_the_digest(changes: dict[str, object]) -> None:
    assert _inputs(**changes).digest() != _inputs().digest()


def test_guest_source_change_keeps_the_debootstrap_cache_key() -> None:
    changed = _inputs(sources=(GuestSource("guest/x.py", b"new"),))
    assert changed.debootstrap.key() == _inputs().debootstrap.key()


def test_debootstrap_key_ignores_package_order_but_not_suite() -> None:
    a = Debootstrap(include=("python3", "ca-certificates"))
    assert a.key() == Debootstrap(include=("ca-certificates", "python3")).key()
    assert a.key() != Debootstrap(suite="trixie", include=a.include).key()
    assert a.key() != Debootstrap(variant="buildd", include=a.include).key()


def test_negative_unknown_template_raises_not_found_without_building() -> None:
    with pytest.raises(TemplateNotFound, match="nope") as info:
        template_digest("nope")
    assert info.value.code == "not_found"


def test_guest_sources_ship_protocol_and_guest_with_an_empty_package_init(tmp_path: Path) -> None:
    (tmp_path / "protocol").mkdir()
    (tmp_path / "guest" / "sub" / "__pycache__").mkdir(parents=True)
    (tmp_path / "protocol" / "_frames.py").write_text("F = 1\n")
    (tmp_path / "guest" / "init.py").write_text("I = 1\n")
    (tmp_path / "guest" / "sub" / "deep.py").write_text("D = 1\n")
    (tmp_path / "guest" / "sub" / "__pycache__" / "deep.py").write_text("stale")
    (tmp_path / "guest" / "notes.txt").write_text("not python")
    (tmp_path / "__init__.py").write_text("import space.sdk\n")
    files = {s.relpath: s.data for s in guest_sources(tmp_path)}
    assert files == {
        "__init__.py": b"",
        "protocol/_frames.py": b"F = 1\n",
        "guest/init.py": b"I = 1\n",
        "guest/sub/deep.py": b"D = 1\n",
    }


DEB822 = """\
Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://source-only.example/debian
Suites: bookworm

Types: deb
# URIs: http://commented.example/debian
Enabled: no
URIs: http://disabled.example/debian
Suites: bookworm

Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://mirror.example/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def test_mirror_is_parsed_from_deb822_sources_skipping_security_src_and_disabled() -> None:
    assert parse_mirror(DEB822, deb822=True) == "http://mirror.example/debian"


def test_mirror_is_parsed_from_one_line_sources_with_options_and_comments() -> None:
    text = (
        "# deb http://commented.example/debian bookworm main\n"
        "deb-src http://src.example/debian bookworm main\n"
        "deb http://security.example/debian-security bookworm-security main\n"
        "deb [arch=amd64 signed-by=/k.gpg] https://mirror.example/debian bookworm main\n"
    )
    assert parse_mirror(text, deb822=False) == "https://mirror.example/debian"


def test_negative_sources_without_a_mirror_give_none() -> None:
    assert parse_mirror("", deb822=True) is None
    assert parse_mirror("deb cdrom:[Debian]/ bookworm main\n", deb822=False) is None


def test_apt_mirror_reads_the_first_file_that_names_one_and_falls_back(tmp_path: Path) -> None:
    sources = tmp_path / "debian.sources"
    sources.write_text(DEB822)
    missing = tmp_path / "missing.list"
    assert apt_mirror([missing, sources]) == "http://mirror.example/debian"
    assert apt_mirror([missing]) == DEFAULT_MIRROR
