"""Rewriting a tenant's ``space.toml`` into its node's names (space.control.template_names).

``rewrite_spec`` reads the TOML, maps ``name`` and a ``template:<name>:<tag>`` base to the
node's names, checks that a ``template@<digest>`` base is one of the tenant's builds (or
base's), and writes the document back as TOML. Everything else is copied unchanged, so
the node checks it exactly as written (its errors name the same key paths). The spec is
written back with inline tables and escaped strings only: one line per top-level key.
"""

from __future__ import annotations

import datetime
import math
import tomllib
from collections.abc import Callable, Set
from typing import Any

from space.control.errors import ApiError
from space.control.template_names import BASE, DIGEST_RE, NAME_RE, node_name

__all__ = ["MAX_SPEC_BYTES", "dumps", "rewrite_spec"]

#: The node's limit on a spec (space/node/templates/spec.py): read whole, so bounded.
MAX_SPEC_BYTES = 4 << 20
_FILE = "space.toml"


def _invalid(key: str, problem: str) -> ApiError:
    where = f"{_FILE}: {key}" if key else _FILE
    return ApiError("invalid_argument", f"{where}: {problem}", key=key)


def rewrite_spec(data: bytes, tenant: str, visible_digests: Set[str]) -> bytes:
    """The spec ``data`` with ``tenant``'s names mapped to the node's.

    ``visible_digests`` are the digests a ``template@<digest>`` base may name. Raises
    ApiError: invalid_argument (too large, not UTF-8 or TOML, a missing or malformed
    ``name`` or template base), conflict (``name = "base"``: base is read-only),
    not_found (a base digest that is not one of ``visible_digests``).
    """
    if len(data) > MAX_SPEC_BYTES:
        raise _invalid("", f"larger than {MAX_SPEC_BYTES} bytes")
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _invalid("", f"not UTF-8: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise _invalid("", f"not valid TOML: {exc}") from None
    name = document.get("name")
    if not isinstance(name, str):
        raise _invalid("name", "is required, a string")
    if name == BASE:
        raise ApiError("conflict", "the template 'base' is shared and read-only", template=BASE)
    document["name"] = node_name(tenant, name)
    if isinstance(document.get("base"), str):
        document["base"] = _map_base(document["base"], tenant, visible_digests)
    return dumps(document).encode()


def _map_base(text: str, tenant: str, visible_digests: Set[str]) -> str:
    if not text.startswith("template"):
        return text  # debian:<release>, or something the node refuses itself
    kind, _, rest = text.partition(":")
    name, _, tag = rest.partition(":")
    if kind == "template" and NAME_RE.fullmatch(name) and NAME_RE.fullmatch(tag):
        return f"template:{node_name(tenant, name)}:{tag}"
    kind, _, digest = text.partition("@")
    if kind == "template" and DIGEST_RE.fullmatch(digest):
        if digest not in visible_digests:
            raise ApiError("not_found", f"no template with digest {digest}", digest=digest)
        return text
    raise _invalid(
        "base", f"{text[:200]!r} is neither 'template:<name>:<tag>' nor 'template@<digest>'"
    )


def dumps(document: dict[str, Any]) -> str:
    """``document`` (as tomllib reads it) as TOML that tomllib reads back equal."""
    return "".join(f"{_string(key)} = {_value(value)}\n" for key, value in document.items())


def _value(value: object) -> str:
    for kind, write in _WRITERS:
        if isinstance(value, kind):
            return write(value)
    raise TypeError(f"not a TOML value: {type(value).__name__}")


def _float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def _array(value: list[Any]) -> str:
    return "[" + ", ".join(_value(item) for item in value) + "]"


def _table(value: dict[str, Any]) -> str:
    items = ", ".join(f"{_string(key)} = {_value(item)}" for key, item in value.items())
    return "{" + items + "}"


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _string(value: str) -> str:
    # TOML basic strings forbid raw control characters (DEL included): escape them all.
    out = (
        _ESCAPES.get(char)
        or (f"\\u{ord(char):04x}" if ord(char) < 0x20 or char == "\x7f" else char)
        for char in value
    )
    return '"' + "".join(out) + '"'


# bool before int (bool is an int); datetime before date (a datetime is a date).
_WRITERS: tuple[tuple[type[Any], Callable[[Any], str]], ...] = (
    (bool, lambda value: "true" if value else "false"),
    (int, str),
    (float, _float),
    (str, _string),
    (list, _array),
    (dict, _table),
    (datetime.datetime, lambda value: value.isoformat()),
    (datetime.date, lambda value: value.isoformat()),
    (datetime.time, lambda value: value.isoformat()),
)
