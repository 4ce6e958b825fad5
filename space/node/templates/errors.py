"""Errors raised while reading template specs and references.

    InvalidArgument (space.node.api.errors), ValueError
    └── TemplateError           root of this package
        ├── TemplateSpecError   a spec is malformed; carries the file and the key path
        └── TemplateRefError    a template reference is malformed; carries the text

Both leaves are ``InvalidArgument``, so a control plane maps them to 422/``invalid_argument``
through its one table, and both are ``ValueError`` for callers outside the node.
"""

from __future__ import annotations

from pathlib import Path

from space.node.api import InvalidArgument

__all__ = ["TemplateError", "TemplateRefError", "TemplateSpecError"]


class TemplateError(InvalidArgument, ValueError):
    """Root of the template spec and reference errors."""


class TemplateSpecError(TemplateError):
    """A template spec is malformed.

    ``file`` is the spec file (None for a spec not read from a file), ``key`` the path of
    the offending value in the document (``steps[2].copy.src``; indices count from 0; ""
    for the document as a whole) and ``problem`` what was wrong with it.
    """

    def __init__(self, file: Path | None, key: str, problem: str) -> None:
        where = ": ".join(str(part) for part in (file, key) if part)
        super().__init__(f"{where}: {problem}" if where else problem)
        self.file = file
        self.key = key
        self.problem = problem


class TemplateRefError(TemplateError):
    """A template reference (``name``, ``name:tag``, ``name@<digest>``) is malformed."""

    def __init__(self, text: str, problem: str) -> None:
        super().__init__(f"invalid template reference {text!r}: {problem}")
        self.text = text
        self.problem = problem
