"""Template references: how a sandbox or another template names a template.

    name                 the tag "latest" of template ``name``
    name:tag             a tag of template ``name``
    name@<digest>        one exact build of ``name``: 64 lowercase hex digits (sha256)

Names and tags match ``[a-z0-9][a-z0-9_.-]{0,63}``. ``parse_ref`` accepts exactly these
forms and raises TemplateRefError for anything else; ``str(ref)`` gives the text back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from space.node.templates.errors import TemplateRefError

__all__ = ["DEFAULT_TAG", "DIGEST_RE", "NAME_RE", "TemplateRef", "parse_ref"]

#: Template names and tags (issue 4).
NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
#: A template digest: the sha256 of its last build step, lowercase hex.
DIGEST_RE = re.compile(r"[0-9a-f]{64}")
DEFAULT_TAG = "latest"
# The longest reference text: a name, "@" and a digest (bounds the work on hostile input).
_MAX_REF_CHARS = 64 + 1 + 64


@dataclass(frozen=True, slots=True)
class TemplateRef:
    """A parsed reference: exactly one of ``tag`` and ``digest`` is set."""

    name: str
    tag: str | None = DEFAULT_TAG
    digest: str | None = None

    def __str__(self) -> str:
        return f"{self.name}@{self.digest}" if self.digest else f"{self.name}:{self.tag}"


def parse_ref(text: str) -> TemplateRef:
    """Parse ``name``, ``name:tag`` or ``name@<64 hex>``; raise TemplateRefError otherwise."""
    if not isinstance(text, str):
        raise TemplateRefError(repr(text), "a reference is a string")
    if len(text) > _MAX_REF_CHARS:
        raise TemplateRefError(text[:_MAX_REF_CHARS] + "...", "too long")
    if "@" in text:
        name, _, digest = text.partition("@")
        _check_name(text, name, "name")
        if not DIGEST_RE.fullmatch(digest):
            raise TemplateRefError(text, "the digest must be 64 lowercase hex digits (sha256)")
        return TemplateRef(name=name, tag=None, digest=digest)
    name, colon, tag = text.partition(":")
    _check_name(text, name, "name")
    if colon:
        _check_name(text, tag, "tag")
        return TemplateRef(name=name, tag=tag)
    return TemplateRef(name=name)


def _check_name(text: str, value: str, what: str) -> None:
    if not NAME_RE.fullmatch(value):
        raise TemplateRefError(text, f"the {what} {value!r} must match {NAME_RE.pattern}")
