"""Template references: name, name:tag and name@digest parse, and nothing else does."""

from __future__ import annotations

import pytest

from space.node.api import InvalidArgument
from space.node.templates import TemplateRef, TemplateRefError, parse_ref

DIGEST = "0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("text", "ref", "canonical"),
    [
        ("py-data", TemplateRef("py-data", tag="latest"), "py-data:latest"),
        ("py-data:v1", TemplateRef("py-data", tag="v1"), "py-data:v1"),
        ("a.b_c-d:1.2_3-x", TemplateRef("a.b_c-d", tag="1.2_3-x"), "a.b_c-d:1.2_3-x"),
        (f"py-data@{DIGEST}", TemplateRef("py-data", tag=None, digest=DIGEST), None),
        ("0:0", TemplateRef("0", tag="0"), "0:0"),
    ],
)
def test_each_reference_form_parses(text: str, ref: TemplateRef, canonical: str | None) -> None:
    assert parse_ref(text) == ref
    assert str(parse_ref(text)) == (canonical or text)


def test_a_parsed_reference_reads_back_from_its_text() -> None:
    for text in ("py-data", "py-data:v1", f"py-data@{DIGEST}"):
        ref = parse_ref(text)
        assert parse_ref(str(ref)) == ref


def test_names_and_tags_of_64_characters_are_accepted() -> None:
    assert parse_ref(f"{'a' * 64}:{'b' * 64}") == TemplateRef("a" * 64, tag="b" * 64)


@pytest.mark.parametrize(
    "text",
    [
        "",
        ":v1",
        "py-data:",
        "@" + DIGEST,
        "py-data@",
        "Py-data",
        "-py",
        ".py",
        "py data",
        " py",
        "py\n",
        "py-data:v1:v2",
        "py-data:V1",
        f"py-data:v1@{DIGEST}",
        f"py-data@{DIGEST[:-1]}",
        f"py-data@{DIGEST}0",
        f"py-data@{DIGEST.upper()}",
        f"py-data@sha256:{DIGEST}",
        "a" * 65,
        f"py:{'b' * 65}",
        "a" * 10_000,
        "py/data",
        "py-dätä",
    ],
)
def test_negative_a_malformed_reference_is_refused(text: str) -> None:
    with pytest.raises(TemplateRefError) as caught:
        parse_ref(text)
    assert isinstance(caught.value, InvalidArgument) and isinstance(caught.value, ValueError)
    assert "invalid template reference" in str(caught.value)


def test_negative_an_overlong_reference_is_cut_in_the_error() -> None:
    with pytest.raises(TemplateRefError) as caught:
        parse_ref("a" * 10_000)
    assert caught.value.problem == "too long"
    assert len(str(caught.value)) < 200


def test_negative_a_reference_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(TemplateRefError, match="a reference is a string"):
        parse_ref(42)  # type: ignore[arg-type]
