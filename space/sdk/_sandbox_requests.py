"""What the sandbox calls send: the create body, the ids they put in URL paths and the
Idempotency-Key header, checked before anything is sent (InvalidArgument, with nothing
on the wire)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from space.limits import IDEMPOTENCY_KEY_CHARS, RESOURCES, MapLimit
from space.sdk._models import SnapshotInfo
from space.sdk.errors import InvalidArgument

__all__ = [
    "create_body",
    "idempotency_header",
    "ports_body",
    "secret_names",
    "segment",
    "snapshot_id",
]

#: What the SDK accepts as an id in a URL path: the API's ids (``sb-``/hex...) and no
#: ``/`` or leading dot, so an id can never name another resource.
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def create_body(
    template: str | None,
    cpus: int | None,
    memory_mib: int | None,
    disk_mib: int | None,
    from_snapshot: SnapshotInfo | str | None,
) -> dict[str, Any]:
    """The sizing part of a create body: only what was given (the API defaults the rest).

    Resources outside space.limits are refused here, as the API would refuse them.
    """
    given = {"template": template, "cpus": cpus, "memory_mib": memory_mib, "disk_mib": disk_mib}
    body: dict[str, Any] = {key: value for key, value in given.items() if value is not None}
    for name, allowed in RESOURCES.items():
        refusal = allowed.refusal(name, body[name]) if name in body else None
        if refusal is not None:
            raise InvalidArgument(refusal, operation="sandbox.create")
    if from_snapshot is not None:
        if body:
            raise InvalidArgument(
                f"from_snapshot sets template, cpus, memory_mib and disk_mib; got {sorted(body)}",
                operation="sandbox.create",
            )
        body["from_snapshot"] = snapshot_id(from_snapshot)
    return body


def ports_body(expose: object, operation: str) -> dict[str, bool]:
    """The API's ``ports`` object for True, False or "public"."""
    if expose == "public":
        return {"enabled": True, "public": True}
    if isinstance(expose, bool):
        return {"enabled": expose, "public": False}
    raise InvalidArgument(
        f"expose_ports is True, False or 'public', not {expose!r}", operation=operation
    )


def bounded_map(
    limit: MapLimit, name: str, value: Mapping[str, str] | None, operation: str
) -> dict[str, str]:
    """``value`` as a dict, refused (InvalidArgument) as the API would refuse it: an
    ``env`` or ``metadata`` over space.limits, or with a bad name."""
    given = dict(value or {})
    refusal = limit.refusal(name, given)
    if refusal is not None:
        raise InvalidArgument(refusal, operation=operation)
    return given


def secret_names(secrets: Sequence[str]) -> list[str]:
    # A string is a sequence of one-letter names: surely a mistake.
    if isinstance(secrets, str):
        raise InvalidArgument(
            "secrets is a list of names, not a string", operation="sandbox.create"
        )
    return [str(name) for name in secrets]


def snapshot_id(snapshot: SnapshotInfo | str) -> str:
    value = snapshot.snapshot_id if isinstance(snapshot, SnapshotInfo) else snapshot
    return segment(value, "snapshot id")


def segment(value: str, what: str) -> str:
    """``value`` if it can stand as one URL path segment; else InvalidArgument."""
    if not isinstance(value, str) or not _ID.match(value):
        raise InvalidArgument(f"not a valid {what}: {value!r}")
    return value


def idempotency_header(
    key: str | None, operation: str, sandbox_id: str | None = None
) -> dict[str, str] | None:
    """The ``Idempotency-Key`` header of a create or fork (None without a key).

    Raises InvalidArgument, before anything is sent, for a key the API would refuse:
    empty, longer than 255 characters or not printable ASCII.
    """
    if key is None:
        return None
    low, high = IDEMPOTENCY_KEY_CHARS
    if (
        not isinstance(key, str)
        or not low <= len(key) <= high
        or not key.isprintable()
        or not key.isascii()
    ):
        raise InvalidArgument(
            f"idempotency_key must be {low} to {high} printable ASCII characters",
            operation=operation,
            sandbox_id=sandbox_id,
        )
    return {"Idempotency-Key": key}
