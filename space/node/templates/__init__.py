"""Templates built from a spec file (issue 4): reading, checking and planning, no VMs.

    spec.py     TemplateSpec and load_spec: the TOML spec, strictly checked
    steps.py    plan: the spec as ordered build steps, each keyed by a content digest
    refs.py     TemplateRef and parse_ref: ``name``, ``name:tag``, ``name@<digest>``
    context.py  unpack_context: a build context (tar, plain or gzip'd) unpacked safely
    errors.py   TemplateError ─┬─ TemplateSpecError (file, key path, problem)
                               └─ TemplateRefError  (both InvalidArgument, ValueError)

The builder (boot a build VM, run each step through the guest daemon, keep each result
as a read-only subvolume keyed by the step's digest) stands on these. See
docs/templates.md.
"""

from __future__ import annotations

from space.node.templates.context import unpack_context
from space.node.templates.errors import TemplateError, TemplateRefError, TemplateSpecError
from space.node.templates.refs import TemplateRef, parse_ref
from space.node.templates.spec import (
    Base,
    CopyStep,
    DebianBase,
    DigestBase,
    ReadyCheck,
    Resources,
    RunStep,
    TemplateBase,
    TemplateConfig,
    TemplateSpec,
    load_spec,
    parse_spec,
    ready_from_record,
)
from space.node.templates.steps import (
    CopyEntry,
    CopyPlan,
    Packages,
    Step,
    describe,
    plan,
    template_digest,
)

__all__ = [
    "Base",
    "CopyEntry",
    "CopyPlan",
    "CopyStep",
    "DebianBase",
    "DigestBase",
    "Packages",
    "ReadyCheck",
    "Resources",
    "RunStep",
    "Step",
    "TemplateBase",
    "TemplateConfig",
    "TemplateError",
    "TemplateRef",
    "TemplateRefError",
    "TemplateSpec",
    "TemplateSpecError",
    "describe",
    "load_spec",
    "parse_ref",
    "parse_spec",
    "plan",
    "ready_from_record",
    "template_digest",
    "unpack_context",
]
