"""The SDK's models read what the control plane's OpenAPI documents, field by field.

For each SDK model, a body is made from the schema of the API object it parses (every
property, each with a value of its own, so a field read from the wrong key shows), the
SDK parses it, and every SDK field must hold its property's value. Properties the SDK
deliberately does not model are listed; a property the API gains is either modelled or
listed, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from space.control import ControlSettings, NodeRegistry, create_app
from space.sdk import (
    EgressEvent,
    FileInfo,
    PoolInfo,
    ProcessInfo,
    SandboxInfo,
    SandboxMetric,
    SecretBinding,
    SecretInfo,
    SnapshotInfo,
    TemplateInfo,
)

#: SDK model -> (API schema, SDK field -> API property where the names differ,
#: API properties the SDK leaves out on purpose).
MODELS: dict[type[Any], tuple[str, dict[str, str], set[str]]] = {
    # ``egress`` is read through ``sandbox.network``.
    SandboxInfo: ("SandboxOut", {"sandbox_id": "id"}, {"egress"}),
    SecretBinding: ("SandboxSecretOut", {}, set()),
    SecretInfo: ("SecretOut", {}, set()),
    SnapshotInfo: ("SnapshotOut", {"snapshot_id": "id"}, set()),
    PoolInfo: ("PoolOut", {}, set()),
    TemplateInfo: ("TemplateOut", {}, set()),
    EgressEvent: ("EgressEventOut", {}, set()),
    ProcessInfo: ("ProcessOut", {}, {"started_at"}),
    FileInfo: ("FileStatOut", {}, set()),
    # ``timestamp_unix`` is ``timestamp`` in whole seconds (E2B's timestampUnix).
    SandboxMetric: ("SandboxMetricOut", {}, {"timestamp_unix"}),
}


@pytest.fixture(scope="module")
def schemas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data_dir: Path = tmp_path_factory.mktemp("openapi")
    app = create_app(ControlSettings(data_dir=data_dir), NodeRegistry())
    found: dict[str, Any] = app.openapi()["components"]["schemas"]
    return found


class _Samples:
    """Distinct example values for a schema's properties."""

    def __init__(self, schemas: dict[str, Any]) -> None:
        self.schemas = schemas
        self.counter: Iterator[int] = itertools.count(1)

    def body(self, name: str) -> dict[str, Any]:
        schema = self.schemas[name]
        return {key: self.value(key, prop) for key, prop in schema["properties"].items()}

    def value(self, key: str, prop: dict[str, Any]) -> Any:
        if "$ref" in prop:
            return self.body(prop["$ref"].rsplit("/", 1)[-1])
        if "anyOf" in prop:  # ``X | None``: the X
            return self.value(key, next(p for p in prop["anyOf"] if p.get("type") != "null"))
        n = next(self.counter)
        kind = prop.get("type")
        if "enum" in prop:
            return prop["enum"][n % len(prop["enum"])]
        if kind == "string":
            if key.endswith("_at") or key in ("time", "timestamp"):
                return datetime.fromtimestamp(1_800_000_000 + n, UTC).isoformat()
            return f"{key}-{n}"
        if kind in ("integer", "number") and "maximum" in prop:  # in range, n-dependent
            low, high = prop.get("minimum", 0), prop["maximum"]
            return low + (high - low) * (n % 97) / 97 if kind == "number" else high
        if kind == "integer":
            return n
        if kind == "number":
            return n + 0.5
        if kind == "boolean":
            return n % 2 == 0
        if kind == "array":
            return [self.value(key, prop.get("items", {"type": "string"}))]
        if kind == "object":
            return {f"{key}-key": f"{key}-{n}"}
        raise AssertionError(f"no sample for {key}: {prop}")


def _same(parsed: Any, wire: Any) -> bool:
    if isinstance(parsed, datetime):
        return parsed == datetime.fromisoformat(wire)
    if dataclasses.is_dataclass(parsed):
        return all(_same(getattr(parsed, f.name), wire[f.name]) for f in dataclasses.fields(parsed))
    if isinstance(parsed, tuple | list):
        return len(parsed) == len(wire) and all(map(_same, parsed, wire))
    return bool(parsed == wire)


def _mismatches(schemas: dict[str, Any], model: type[Any], schema_name: str) -> list[str]:
    """What ``model`` parses wrongly from a body made from ``schema_name``."""
    renamed = MODELS[model][1] if model in MODELS else {}
    body = _Samples(schemas).body(schema_name)
    parsed = model.from_wire(body)
    wrong = []
    for field in dataclasses.fields(model):
        key = renamed.get(field.name, field.name)
        if key not in body:
            wrong.append(f"{field.name}: {schema_name} has no {key!r}")
        elif not _same(value := getattr(parsed, field.name), body[key]):
            wrong.append(f"{field.name}: {value!r} != {body[key]!r}")
    return wrong


@pytest.mark.parametrize("model", list(MODELS), ids=lambda m: m.__name__)
def test_every_sdk_field_holds_the_documented_property_it_is_read_from(
    schemas: dict[str, Any], model: type[Any]
) -> None:
    assert _mismatches(schemas, model, MODELS[model][0]) == []


@pytest.mark.parametrize("model", list(MODELS), ids=lambda m: m.__name__)
def test_every_documented_property_is_modelled_or_left_out_on_purpose(
    schemas: dict[str, Any], model: type[Any]
) -> None:
    schema_name, renamed, left_out = MODELS[model]
    read = {renamed.get(f.name, f.name) for f in dataclasses.fields(model)}
    documented = set(schemas[schema_name]["properties"])
    assert documented - read == left_out
    assert left_out <= documented  # a stale entry here would hide nothing


def test_negative_a_field_read_from_the_wrong_key_is_caught(schemas: dict[str, Any]) -> None:
    @dataclasses.dataclass(frozen=True)
    class Swapped:
        hits: int
        misses: int

        @classmethod
        def from_wire(cls, body: dict[str, Any]) -> Swapped:
            return cls(hits=body["misses"], misses=body["hits"])

    assert len(_mismatches(schemas, Swapped, "PoolOut")) == 2
