"""JSON and NDJSON shapes of space.node.api.interface objects on HTTP.

Shared by the node's HTTP API, RemoteNode (its client) and the control plane, whose
exec streams have the same NDJSON lines (docs/api.md, "Commands").

A template build answers NDJSON too, one object with one key per line: ``{"log": str}``
for each log line, then one ``{"template": TemplateInfo}`` (succeeded) or ``{"failed":
{"code", "message", "step"}}``; the build's id travels in the ``X-Build-Id`` header.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from space.limits import MAX_EGRESS_LOG_EVENTS, MAX_FORK_CHILDREN
from space.node.api.errors import InvalidArgument, NodeError
from space.node.api.interface import (
    BuildEvent,
    BuildFailed,
    BuildLog,
    BuildStream,
    BuildSucceeded,
    ExecEvent,
    ExecOutput,
    ExecRequest,
    ExecStream,
    PtySize,
    SecretGrant,
    TemplateInfo,
    WatchEvent,
    WatchStream,
)

__all__ = [
    "BUILD_ID_HEADER",
    "FILE_STAT_HEADER",
    "MAX_BUILD_LOG_BYTES",
    "MAX_EGRESS_LOG_EVENTS",
    "MAX_FORK_CHILDREN",
    "NDJSON",
    "NODE_API_PREFIX",
    "STATUS_BY_CODE",
    "build_event_line",
    "build_lines",
    "decode",
    "decode_build_event",
    "decode_child_ids",
    "decode_egress_policy",
    "decode_exec_request",
    "decode_grants",
    "decode_pty_size",
    "decode_snapshot_id",
    "decode_templates",
    "decode_watch_event",
    "encode",
    "encode_exec_request",
    "encode_grants",
    "encode_templates",
    "error_line",
    "event_line",
    "ndjson_lines",
    "watch_lines",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

NDJSON = "application/x-ndjson"
#: Where the node's HTTP API is mounted (space.node.http.server; the client prepends it).
NODE_API_PREFIX = "/node/v1"
FILE_STAT_HEADER = "X-Space-File-Stat"
BUILD_ID_HEADER = "X-Build-Id"
#: Longest ``log`` line of a build a client accepts (the node cuts longer log lines).
MAX_BUILD_LOG_BYTES = 64 * 1024
#: Most children one fork request may make: each is a whole VM on a node of a few cores.
#: Most egress events one log request may ask for (the REST API's limit too).

#: The one error code → HTTP status table, shared by the REST API (docs/api.md,
#: "Errors") and the node API, which answer with the same codes. Where two codes share a
#: status, the last one is what a bare status (a framework's 503) stands for.
STATUS_BY_CODE: dict[str, int] = {
    "unauthenticated": 401,
    "permission_denied": 403,
    "not_found": 404,
    "conflict": 409,
    "invalid_argument": 422,
    "resource_exhausted": 429,
    "internal": 500,
    "connection_refused": 502,
    "capacity": 503,
    "unavailable": 503,
    "timeout": 504,
}


_ADAPTERS: dict[object, TypeAdapter[Any]] = {}


def _adapter(cls: Any) -> TypeAdapter[Any]:
    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    return adapter


def encode(value: object) -> Any:
    """A JSON-ready form of a space.node.api.interface dataclass."""
    return _adapter(type(value)).dump_python(value, mode="json")


def decode(cls: type[T], data: object) -> T:
    """Validate ``data`` as ``cls``; raises pydantic.ValidationError when malformed."""
    value: T = _adapter(cls).validate_python(data)
    return value


def encode_exec_request(request: ExecRequest) -> dict[str, Any]:
    body: dict[str, Any] = encode(dataclasses.replace(request, stdin=None))
    body["stdin"] = None if request.stdin is None else base64.b64encode(request.stdin).decode()
    return body


def decode_exec_request(body: object) -> ExecRequest:
    """Raises InvalidArgument for a malformed body (bad base64 included)."""
    if not isinstance(body, dict):
        raise InvalidArgument("exec body must be a JSON object")
    stdin = body.get("stdin")
    try:
        raw = None if stdin is None else base64.b64decode(str(stdin), validate=True)
        request = decode(ExecRequest, {**body, "stdin": None})
    except (ValueError, ValidationError) as exc:
        raise InvalidArgument(f"malformed exec request: {exc}") from exc
    return ExecRequest(
        argv=request.argv,
        cmd=request.cmd,
        env=request.env,
        cwd=request.cwd,
        user=request.user,
        timeout_s=request.timeout_s,
        background=request.background,
        stdin=raw,
        open_stdin=request.open_stdin,
        pty=request.pty,
        tag=request.tag,
        follow=request.follow,
    )


def decode_pty_size(body: object) -> PtySize:
    """A ``{"rows": int, "cols": int}`` body; InvalidArgument when malformed (the range
    is the channel's to check)."""
    try:
        return decode(PtySize, body)
    except ValidationError as exc:
        raise InvalidArgument(f"malformed pty size: {exc}") from exc


def decode_snapshot_id(body: object) -> str:
    """The ``snapshot_id`` of a ``{"snapshot_id": str}`` body.

    Raises InvalidArgument unless ``body`` is an object whose ``snapshot_id`` is a
    non-empty string (whether such a snapshot exists is the node's to say).
    """
    value = body.get("snapshot_id") if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise InvalidArgument("snapshot_id must be a non-empty string")
    return value


def decode_child_ids(body: object) -> list[str]:
    """The ``child_ids`` of a fork body ``{"child_ids": [str, ...]}``.

    Raises InvalidArgument unless ``child_ids`` is a list of 1 to MAX_FORK_CHILDREN
    distinct non-empty strings.
    """
    ids = body.get("child_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_FORK_CHILDREN:
        raise InvalidArgument(
            f"child_ids must be a list of 1 to {MAX_FORK_CHILDREN} sandbox ids,"
            f" got {len(ids) if isinstance(ids, list) else type(ids).__name__}"
        )
    if not all(isinstance(child, str) and child for child in ids):
        raise InvalidArgument("every child id must be a non-empty string")
    if len(set(ids)) != len(ids):
        raise InvalidArgument("child_ids must be distinct")
    return list(ids)


def decode_egress_policy(body: object) -> dict[str, object] | None:
    """The ``policy`` of a ``{"policy": {...} | null}`` body (``PUT .../egress``).

    Raises InvalidArgument unless ``body`` is an object holding ``policy``, an object or
    null; whether the policy itself is well-formed is the node's to say.
    """
    if not isinstance(body, dict) or "policy" not in body:
        raise InvalidArgument('egress body must be {"policy": {...} or null}')
    policy = body["policy"]
    if policy is not None and not isinstance(policy, dict):
        raise InvalidArgument("policy must be an object or null")
    return policy


_GRANT_KEYS = frozenset(
    {"name", "value", "placeholder", "hosts", "env", "injection", "header", "format"}
)
_GRANT_OPTIONAL = {"env": None, "injection": "placeholder", "header": None, "format": "{value}"}


def encode_grants(grants: list[SecretGrant]) -> dict[str, Any]:
    """The ``PUT .../secrets`` body: ``{"grants": [{name, value, placeholder, hosts, env,
    injection, header, format}, ...]}``. It holds values: never log it."""
    return {"grants": [_grant_json(grant) for grant in grants]}


def _grant_json(grant: SecretGrant) -> dict[str, Any]:
    return {
        "name": grant.name,
        "value": grant.value,
        "placeholder": grant.placeholder,
        "hosts": list(grant.hosts),
        "env": grant.env,
        "injection": grant.injection,
        "header": grant.header,
        "format": grant.format,
    }


def decode_grants(body: object) -> list[SecretGrant]:
    """The grants of a ``{"grants": [...]}`` body, types checked (their rules are
    space.node.api.secret_grants.check_grants').

    Raises InvalidArgument naming the grant's position and field, never a value (a
    validation library's message would quote its input).
    """
    grants = body.get("grants") if isinstance(body, dict) else None
    if not isinstance(grants, list):
        raise InvalidArgument('secrets body must be {"grants": [...]}')
    return [_grant(item, f"grants[{i}]") for i, item in enumerate(grants)]


def _grant(item: object, where: str) -> SecretGrant:
    if not isinstance(item, dict) or not _GRANT_KEYS.issuperset(item):
        raise InvalidArgument(f"{where} must be an object with keys {sorted(_GRANT_KEYS)}")
    fields = {**_GRANT_OPTIONAL, **item}
    for key in ("name", "value", "placeholder", "injection", "format"):
        if not isinstance(fields.get(key), str):
            raise InvalidArgument(f"{where}.{key} must be a string")
    for key in ("env", "header"):
        if fields[key] is not None and not isinstance(fields[key], str):
            raise InvalidArgument(f"{where}.{key} must be a string or null")
    hosts = fields.get("hosts")
    if not isinstance(hosts, list) or not all(isinstance(host, str) for host in hosts):
        raise InvalidArgument(f"{where}.hosts must be a list of strings")
    if fields["injection"] not in ("placeholder", "header"):
        raise InvalidArgument(f"{where}.injection must be 'placeholder' or 'header'")
    return SecretGrant(
        name=fields["name"],
        value=fields["value"],
        placeholder=fields["placeholder"],
        hosts=tuple(hosts),
        env=fields["env"],
        injection=fields["injection"],
        header=fields["header"],
        format=fields["format"],
    )


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def event_line(event: ExecEvent) -> bytes:
    """One NDJSON line for an exec event (docs/api.md, "Commands")."""
    if isinstance(event, ExecOutput):
        return _line({"type": event.stream, "data": base64.b64encode(event.data).decode()})
    return _line(
        {
            "type": "exit",
            "exit_code": event.exit_code,
            "signal": event.signal,
            "timed_out": event.timed_out,
        }
    )


def error_line(code: str, message: str) -> bytes:
    return _line({"type": "error", "code": code, "message": message})


async def ndjson_lines(
    stream: ExecStream, error_text: Callable[[str], str] = str
) -> AsyncIterator[bytes]:
    """``start``, each event as produced, then nothing (or an ``error`` line if it fails;
    its message passed through ``error_text``).

    Closing the iterator early (client gone) closes ``stream``: a foreground process is
    killed, a background one keeps running.
    """
    try:
        start = {"type": "start", "pid": stream.pid, "process_id": stream.process_id}
        yield _line(start | {"pty": stream.pty})
        async for event in stream:
            yield event_line(event)
    except NodeError as exc:
        yield error_line(exc.code, error_text(exc.message))
    except Exception as exc:
        log.exception("exec stream failed")
        yield error_line("internal", f"stream failed: {type(exc).__name__}")
    finally:
        await stream.aclose()


def _watch_line(event: WatchEvent) -> bytes:
    if event.type == "dropped":
        return _line({"type": "dropped", "count": event.count})
    return _line(
        {"type": event.type, "path": event.path, "name": event.name, "is_dir": event.is_dir}
    )


async def watch_lines(
    stream: WatchStream, error_text: Callable[[str], str] = str
) -> AsyncIterator[bytes]:
    """``{"type": "start", "path"}``, each change as it happens (docs/api.md, "Watching
    a directory"), then nothing or an ``error`` line. Closing the iterator early (client
    gone) closes ``stream``: the guest releases the watch."""
    try:
        yield _line({"type": "start", "path": stream.path})
        async for event in stream:
            yield _watch_line(event)
    except NodeError as exc:
        yield error_line(exc.code, error_text(exc.message))
    except Exception as exc:
        log.exception("watch stream failed")
        yield error_line("internal", f"stream failed: {type(exc).__name__}")
    finally:
        await stream.aclose()


def decode_watch_event(obj: dict[str, Any]) -> WatchEvent:
    """A change line of ``watch_lines`` (not ``start`` or ``error``); raises ValueError
    or pydantic.ValidationError when malformed."""
    if obj.get("type") == "dropped":
        return WatchEvent("dropped", count=decode(int, obj.get("count")))
    return decode(WatchEvent, {k: obj.get(k) for k in ("type", "path", "name", "is_dir")})


def encode_templates(templates: list[TemplateInfo]) -> dict[str, Any]:
    """The ``GET /templates`` body: ``{"templates": [TemplateInfo, ...]}``."""
    return {"templates": [encode(info) for info in templates]}


def decode_templates(body: object) -> list[TemplateInfo]:
    """The templates of a ``{"templates": [...]}`` body; raises ValueError when malformed."""
    if not isinstance(body, dict) or "templates" not in body:
        raise ValueError("no 'templates' in the answer")
    return decode(list[TemplateInfo], body["templates"])


def build_event_line(event: BuildEvent) -> bytes:
    """One NDJSON line for a build event; a log line is cut to MAX_BUILD_LOG_BYTES."""
    if isinstance(event, BuildLog):
        return _log_line(event.line)
    if isinstance(event, BuildSucceeded):
        return _line({"template": encode(event.template)})
    return _line({"failed": encode(event)})


def _log_line(text: str) -> bytes:
    line = _line({"log": text})
    if len(line) <= MAX_BUILD_LOG_BYTES:
        return line
    # JSON writes one character as at most 12 bytes (a surrogate pair): this fits.
    keep = (MAX_BUILD_LOG_BYTES - 128) // 12
    return _line({"log": f"{text[:keep]} [{len(text) - keep} characters cut]"})


def decode_build_event(line: bytes) -> BuildEvent:
    """The build event of one NDJSON line.

    Raises ValueError when the line is not JSON, not an object with exactly one of the
    keys ``log``, ``template``, ``failed``, holds malformed fields, or is a ``log``
    line longer than MAX_BUILD_LOG_BYTES.
    """
    obj = json.loads(line)
    if not isinstance(obj, dict) or len(obj) != 1:
        raise ValueError("a build event is an object with one key")
    ((kind, value),) = obj.items()
    if kind == "log":
        if len(line) > MAX_BUILD_LOG_BYTES:
            raise ValueError(f"a log line of {len(line)} bytes (at most {MAX_BUILD_LOG_BYTES})")
        if not isinstance(value, str):
            raise ValueError("a log line must be a string")
        return BuildLog(value)
    if kind == "template":
        return BuildSucceeded(decode(TemplateInfo, value))
    if kind == "failed":
        return decode(BuildFailed, value)
    raise ValueError(f"unknown build event {str(kind)[:64]!r}")


async def build_lines(stream: BuildStream) -> AsyncIterator[bytes]:
    """Each build event's line as produced; a stream that raises ends with a ``failed`` line.

    Closing the iterator early (client gone) closes ``stream``: the build carries on to
    its end on the node.
    """
    try:
        async for event in stream:
            yield build_event_line(event)
    except NodeError as exc:
        yield build_event_line(BuildFailed(exc.code, exc.message))
    except Exception as exc:
        log.exception("build stream %s failed", stream.build_id)
        yield build_event_line(BuildFailed("internal", f"stream failed: {type(exc).__name__}"))
    finally:
        await stream.aclose()
