"""Tenant-scoped template names: what a tenant calls a template and what its node does.

Nodes keep one namespace of templates; tenants must not see, use or delete each other's.
So a tenant's template ``py`` is stored on the node as ``<prefix>py``, where the prefix
is ``t`` + the first 16 hex digits of the SHA-256 of the tenant id + ``.`` (18
characters: node names are at most 64, so a tenant's names are at most 46). Every name
that crosses the seam is mapped: ``node_ref`` on the way in, ``tenant_name`` on the way
out (None for a name that is not the tenant's: it is never shown). ``base`` is the same
on both sides, shared by every tenant and read-only. A node's own text that quotes a
node name is cleaned by space.control.node_text.

References are ``name`` (tag ``latest``), ``name:tag`` or ``name@<64 hex>`` with names
and tags matching ``[a-z0-9][a-z0-9_.-]{0,63}``, as the node's own parser
(space/node/templates/refs.py, which this layer may not import) reads them.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from space.control.errors import ApiError

__all__ = [
    "BASE",
    "MAX_TENANT_NAME_CHARS",
    "REF_PATTERN",
    "TemplateRef",
    "node_name",
    "node_ref",
    "parse_ref",
    "tenant_name",
    "tenant_prefix",
]

BASE = "base"
_NAME = r"[a-z0-9][a-z0-9_.-]{0,63}"
NAME_RE = re.compile(_NAME)
DIGEST_RE = re.compile(r"[0-9a-f]{64}")
#: A whole reference, as a pattern for request validation.
REF_PATTERN = rf"^{_NAME}(:{_NAME}|@[0-9a-f]{{64}})?$"
_REF_RE = re.compile(REF_PATTERN)
# 64 bits of the tenant id's hash: tenants are made by operators, so only an accidental
# collision matters, and 2**64 makes that negligible for any number of tenants.
_TAG_HEX = 16
_MAX_NODE_NAME_CHARS = 64
#: The longest template name a tenant may use: the node's limit less the prefix.
MAX_TENANT_NAME_CHARS = _MAX_NODE_NAME_CHARS - (_TAG_HEX + 2)


@dataclass(frozen=True, slots=True)
class TemplateRef:
    """A parsed reference: exactly one of ``tag`` and ``digest`` is set."""

    name: str
    tag: str | None = "latest"
    digest: str | None = None

    def __str__(self) -> str:
        return f"{self.name}@{self.digest}" if self.digest else f"{self.name}:{self.tag}"


def parse_ref(text: str) -> TemplateRef:
    """Parse ``name``, ``name:tag`` or ``name@<64 hex>``; ApiError(invalid_argument) else."""
    if len(text) > 2 * _MAX_NODE_NAME_CHARS + 1 or not _REF_RE.fullmatch(text):
        raise ApiError(
            "invalid_argument",
            f"invalid template reference {text[:200]!r}: use name, name:tag or name@<digest>",
            template=text[:200],
        )
    if "@" in text:
        name, _, digest = text.partition("@")
        return TemplateRef(name, None, digest)
    name, _, tag = text.partition(":")
    return TemplateRef(name, tag or "latest")


def tenant_prefix(tenant: str) -> str:
    """The prefix of ``tenant``'s template names on nodes: ``t`` + 16 hex + ``.``."""
    return "t" + hashlib.sha256(tenant.encode()).hexdigest()[:_TAG_HEX] + "."


def node_name(tenant: str, name: str) -> str:
    """The node's name for ``tenant``'s template ``name`` (``base`` stays ``base``).

    Raises ApiError(invalid_argument) for a malformed name or one longer than
    MAX_TENANT_NAME_CHARS.
    """
    if name == BASE:
        return BASE
    if not NAME_RE.fullmatch(name):
        raise ApiError("invalid_argument", f"invalid template name {name!r}", template=name)
    if len(name) > MAX_TENANT_NAME_CHARS:
        raise ApiError(
            "invalid_argument",
            f"template name {name!r} is {len(name)} characters; "
            f"at most {MAX_TENANT_NAME_CHARS} are allowed",
            template=name,
            limit=MAX_TENANT_NAME_CHARS,
        )
    return tenant_prefix(tenant) + name


def node_ref(tenant: str, text: str) -> str:
    """The node's spelling of ``tenant``'s reference ``text`` (same form: tag or digest).

    Raises as ``parse_ref`` and ``node_name``.
    """
    ref = parse_ref(text)
    name = node_name(tenant, ref.name)
    if ref.digest is not None:
        return f"{name}@{ref.digest}"
    return name if ":" not in text else f"{name}:{ref.tag}"


def tenant_name(tenant: str, name: str) -> str | None:
    """The tenant's name for the node's template ``name``; None if not theirs nor base."""
    if name == BASE:
        return BASE
    prefix = tenant_prefix(tenant)
    return name[len(prefix) :] if name.startswith(prefix) and len(name) > len(prefix) else None
