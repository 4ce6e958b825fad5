"""Checks on the secrets a sandbox's gateway may inject (space.node.api.interface.SecretGrant).

Pure, shared by the control plane (to refuse a bad secret with a 422) and the node. A
value ends up inside HTTP headers, so anything that could split a header (CR, LF, NUL)
is refused; error messages name the grant and the field, never the value.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from publicsuffixlist import PublicSuffixList

from space.limits import MAX_SANDBOX_SECRETS
from space.node.api.egress_policy import DomainRule, EgressPolicy
from space.node.api.errors import InvalidArgument
from space.node.api.interface import SecretGrant

__all__ = [
    "MAX_GRANTS",
    "check_grants",
    "check_header_name",
    "check_host_patterns",
    "check_secret_name",
    "check_secret_value",
    "host_matches",
]

MAX_GRANTS = MAX_SANDBOX_SECRETS
MAX_HOSTS = 32
MAX_VALUE_BYTES = 16 * 1024
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_PLACEHOLDER = re.compile(r"[A-Za-z0-9_-]{16,128}")
# RFC 9110 token characters.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
# Headers that frame the request or name its destination: a secret must never set them.
_FRAMING = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer"}
)
_UNSAFE = re.compile(r"[\r\n\0]")


def check_secret_name(name: object, what: str = "name") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgument(f"{what} must be a letter or _ then up to 63 of [A-Za-z0-9_]")
    return name


def check_secret_value(value: object, what: str = "value") -> str:
    """The value as a str; InvalidArgument (without the value) if it cannot be sent."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{what} must be a non-empty string")
    if len(value.encode()) > MAX_VALUE_BYTES:
        raise InvalidArgument(f"{what} is over {MAX_VALUE_BYTES} bytes")
    if _UNSAFE.search(value) or not value.isprintable():
        raise InvalidArgument(f"{what} holds a control character (CR, LF, NUL, ...)")
    return value


def check_host_patterns(hosts: object, what: str = "hosts") -> tuple[str, ...]:
    """Domain patterns as in egress rules ("api.example.com", "*.example.com"), each
    within one registrable domain (see ``_check_registrable``)."""
    if not isinstance(hosts, list | tuple) or not 1 <= len(hosts) <= MAX_HOSTS:
        raise InvalidArgument(f"{what} must be a list of 1..{MAX_HOSTS} domain patterns")
    rules = [{"domain": host} for host in hosts]
    try:
        policy = EgressPolicy.parse({"allow": rules})
    except InvalidArgument as exc:
        raise InvalidArgument(exc.message.replace("allow[", f"{what}[", 1)) from exc
    patterns = tuple(rule.pattern for rule in policy.domains)
    for index, pattern in enumerate(patterns):
        _check_registrable(pattern, f"{what}[{index}]")
    return patterns


def _check_registrable(pattern: str, what: str) -> None:
    """A secret goes only to hosts of one owner: the labels after a pattern's last ``*``
    must be a registrable domain or a name under one, by the Public Suffix List. So
    ``*``, ``*.*``, ``*.com``, ``com``, ``*.co.uk`` and ``*.github.io`` (a suffix under
    which anyone registers) are refused; ``*.example.com`` is not. A name under a
    suffix the list does not know (``x.test``) counts as registrable."""
    fixed = pattern.split(".")
    if "*" in fixed:
        fixed = fixed[len(fixed) - fixed[::-1].index("*") :]
    if _public_suffixes().privatesuffix(".".join(fixed)) is None:
        raise InvalidArgument(
            f"{what} {pattern!r} is not within one registrable domain (such as "
            "'api.example.com' or '*.example.com'): a secret cannot be bound to every "
            "host under a public suffix"
        )


@functools.cache
def _public_suffixes() -> PublicSuffixList:
    return PublicSuffixList()  # the list bundled with the package: no network


def check_header_name(header: object, what: str = "header") -> str:
    if not isinstance(header, str) or not _TOKEN.fullmatch(header):
        raise InvalidArgument(f"{what} must be an HTTP header name")
    if header.lower() in _FRAMING:
        raise InvalidArgument(f"{what} {header!r} frames the request; a secret cannot set it")
    return header


def host_matches(patterns: Sequence[str], name: str) -> bool:
    return any(DomainRule(pattern, frozenset()).matches(name) for pattern in patterns)


def check_grants(grants: Sequence[SecretGrant]) -> None:
    """InvalidArgument naming the first bad grant and field (never its value)."""
    if len(grants) > MAX_GRANTS:
        raise InvalidArgument(f"at most {MAX_GRANTS} secrets per sandbox")
    seen_names: set[str] = set()
    seen_placeholders: set[str] = set()
    for grant in grants:
        where = f"secret {grant.name!r}"
        check_secret_name(grant.name, f"{where}: name")
        check_secret_value(grant.value, f"{where}: value")
        if not _PLACEHOLDER.fullmatch(grant.placeholder):
            raise InvalidArgument(f"{where}: placeholder must be 16..128 of [A-Za-z0-9_-]")
        if grant.placeholder in grant.value:
            raise InvalidArgument(f"{where}: placeholder must not occur in the value")
        check_host_patterns(list(grant.hosts), f"{where}: hosts")
        if grant.env is not None:
            check_secret_name(grant.env, f"{where}: env")
        _check_injection(grant, where)
        if grant.name in seen_names or grant.placeholder in seen_placeholders:
            raise InvalidArgument(f"{where}: name or placeholder given twice")
        seen_names.add(grant.name)
        seen_placeholders.add(grant.placeholder)


def _check_injection(grant: SecretGrant, where: str) -> None:
    if grant.injection == "placeholder":
        return
    if grant.injection != "header":
        raise InvalidArgument(f"{where}: injection must be 'placeholder' or 'header'")
    check_header_name(grant.header, f"{where}: header")
    if grant.format.count("{value}") != 1 or _UNSAFE.search(grant.format):
        raise InvalidArgument(f"{where}: format must hold '{{value}}' once and no CR or LF")
