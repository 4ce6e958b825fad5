"""Typed reading of a parsed TOML document, failing with the key path of a bad value.

Private to space.node.templates. Every check raises TemplateSpecError through ``Where``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from space.node.templates.errors import TemplateSpecError

__all__ = ["Where", "absolute_path", "child", "index"]

# Paths in the guest: the kernel's PATH_MAX (include/uapi/linux/limits.h).
_MAX_PATH_BYTES = 4096
_IDENTIFIER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def child(key: str, name: str) -> str:
    """The key path of table entry ``name`` under ``key`` (quoted when not a bare word)."""
    if not _IDENTIFIER_RE.fullmatch(name):
        return f"{key}[{name!r}]"
    return f"{key}.{name}" if key else name


def index(key: str, position: int) -> str:
    """The key path of item ``position`` (from 0) of the array at ``key``."""
    return f"{key}[{position}]"


@dataclass(frozen=True, slots=True)
class Where:
    """The spec being read, to name it in errors."""

    file: Path | None

    def fail(self, key: str, problem: str) -> NoReturn:
        raise TemplateSpecError(self.file, key, problem)

    def mapping(self, value: object, key: str) -> dict[str, object]:
        """``value`` as a table, whatever its keys."""
        if not isinstance(value, dict):
            self.fail(key, f"must be a table, got {_kind(value)}")
        return value

    def table(self, value: object, key: str, allowed: Iterable[str]) -> dict[str, object]:
        """``value`` as a table holding no key outside ``allowed``."""
        value = self.mapping(value, key)
        known = set(allowed)
        for name in value:
            if name not in known:
                self.fail(child(key, name), f"unknown key (allowed: {', '.join(sorted(known))})")
        return value

    def array(self, value: object, key: str, max_items: int) -> list[object]:
        """``value`` as an array of at most ``max_items`` items."""
        if not isinstance(value, list):
            self.fail(key, f"must be an array, got {_kind(value)}")
        if len(value) > max_items:
            self.fail(key, f"at most {max_items} items, got {len(value)}")
        return value

    def string(
        self, value: object, key: str, *, max_bytes: int, pattern: re.Pattern[str] | None = None
    ) -> str:
        """``value`` as a string of at most ``max_bytes`` UTF-8 bytes, matching ``pattern``."""
        if not isinstance(value, str):
            self.fail(key, f"must be a string, got {_kind(value)}")
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            self.fail(key, f"at most {max_bytes} bytes, got {size}")
        if "\0" in value:
            self.fail(key, "must not contain a NUL character")
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(key, f"{value!r} must match {pattern.pattern}")
        return value

    def command(self, value: object, key: str, max_bytes: int) -> str:
        """A shell command: a string with something in it besides white space."""
        text = self.string(value, key, max_bytes=max_bytes)
        if not text.strip():
            self.fail(key, "must not be empty")
        return text

    def integer(self, value: object, key: str, low: int, high: int) -> int:
        """``value`` as an integer within ``low..high`` (booleans are not integers)."""
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(key, f"must be an integer, got {_kind(value)}")
        if not low <= value <= high:
            self.fail(key, f"must be within {low}..{high}, got {value}")
        return value


def absolute_path(where: Where, value: object, key: str) -> str:
    """A guest path: absolute, no ``..``; returned without ``.``, repeated or final ``/``."""
    text = where.string(value, key, max_bytes=_MAX_PATH_BYTES)
    if not text.startswith("/"):
        where.fail(key, f"{text!r} must be an absolute path")
    parts = [part for part in text.split("/") if part not in ("", ".")]
    if ".." in parts:
        where.fail(key, f"{text!r} must not contain '..'")
    return "/" + "/".join(parts)


def _kind(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}
    names |= {list: "an array", dict: "a table"}
    return names.get(type(value), type(value).__name__)
