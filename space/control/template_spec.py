"""Rewriting a tenant's ``space.toml`` into its node's names (space.control.template_names).

``rewrite_spec`` reads the TOML, maps ``name`` and a ``template:<name>:<tag>`` base to the
node's names, checks that a ``template@<digest>`` base is one of the tenant's builds (or
base's), and writes the document back as TOML with tomli-w (the writer paired with
tomllib; issue 16). Everything else is copied unchanged, so the node checks it exactly
as written (its errors name the same key paths).
"""

from __future__ import annotations

import tomllib
from collections.abc import Set

import tomli_w

from space.control.errors import ApiError
from space.control.template_names import BASE, DIGEST_RE, NAME_RE, node_name

__all__ = ["MAX_SPEC_BYTES", "rewrite_spec"]

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
    return tomli_w.dumps(document).encode()


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
