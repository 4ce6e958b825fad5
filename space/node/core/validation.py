"""Checks of what a node is asked to do, before anything is done.

For the node agent (space.node.agent). Every function raises InvalidArgument (or
NotFound for a missing template or snapshot) and changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from space.limits import MAX_FORK_CHILDREN, RESOURCES
from space.node.api import GUEST_CHOICES, InvalidArgument, NodeError, SandboxSpec, SnapshotInfo
from space.node.core.template import Template

__all__ = [
    "MAX_FORK_CHILDREN",
    "auto_guest",
    "check_compatible",
    "check_id",
    "check_spec",
    "resolve_guest",
]

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def check_id(value: object, kind: str = "sandbox id") -> str:
    """``value`` if it is a valid sandbox or snapshot id ([A-Za-z0-9_.-], at most 63)."""
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise InvalidArgument(f"invalid {kind} {value!r}: want [A-Za-z0-9_.-], at most 63")
    return value


def check_spec(spec: SandboxSpec, resolve: Callable[[str], Template]) -> Template:
    """The template of a valid ``spec``; resources within limits, env of strings.

    ``resolve`` finds a template by reference (NotFound, InvalidArgument).
    """
    check_id(spec.sandbox_id)
    for name, allowed in RESOURCES.items():
        refusal = allowed.refusal(name, getattr(spec, name))
        if refusal is not None:
            raise InvalidArgument(refusal, sandbox_id=spec.sandbox_id)
    if not isinstance(spec.template, str):
        raise InvalidArgument("template must be a string", sandbox_id=spec.sandbox_id)
    try:
        template = resolve(spec.template)
    except NodeError as exc:
        exc.sandbox_id = spec.sandbox_id
        raise
    _check_disk(spec, template)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in spec.env.items()):
        raise InvalidArgument("env must map strings to strings", sandbox_id=spec.sandbox_id)
    if spec.guest not in GUEST_CHOICES:
        raise InvalidArgument(
            f"guest must be one of {', '.join(GUEST_CHOICES)}, got {spec.guest!r}",
            sandbox_id=spec.sandbox_id,
        )
    return template


def auto_guest(*, kvm: bool, without_kvm: str) -> str:
    """The guest type ``auto`` stands for on a node (and its warm pools' type)."""
    return "qemu" if kvm else without_kvm


def resolve_guest(spec: SandboxSpec, *, kvm: bool, without_kvm: str, offered: Sequence[str]) -> str:
    """The guest type a sandbox of ``spec`` runs on this node: its own choice, or for
    ``auto`` QEMU where KVM works and ``without_kvm`` (NodeConfig.guest_without_kvm)
    where it does not. Raises InvalidArgument if the node does not offer that type.
    """
    choice = spec.guest
    if choice == "auto":
        choice = auto_guest(kvm=kvm, without_kvm=without_kvm)
    if choice not in offered:
        raise InvalidArgument(
            f"guest {choice} is not offered by this node (it offers {', '.join(offered)})",
            sandbox_id=spec.sandbox_id,
        )
    return choice


def _check_disk(spec: SandboxSpec, template: Template) -> None:
    if spec.disk_mib < template.min_disk_mib:
        raise InvalidArgument(
            f"disk_mib must be at least the template's {template.min_disk_mib}, "
            f"got {spec.disk_mib}",
            sandbox_id=spec.sandbox_id,
        )
    # A disk a guest wrote is never grown by the host (it would parse it).
    if not template.pristine and spec.disk_mib != template.min_disk_mib:
        raise InvalidArgument(
            f"template {spec.template} has a disk of {template.min_disk_mib} MiB; "
            f"disk_mib must be that, got {spec.disk_mib}",
            sandbox_id=spec.sandbox_id,
        )


def check_compatible(spec: SandboxSpec, snapshot: SnapshotInfo, guest: str | None = None) -> None:
    """A sandbox of ``spec`` (of the guest type ``guest``, when known) can run
    ``snapshot``'s memory: same template, resources and guest type."""
    if guest is not None and guest != snapshot.guest:
        raise InvalidArgument(
            f"snapshot {snapshot.snapshot_id} is of a {snapshot.guest} sandbox, not {guest}",
            sandbox_id=spec.sandbox_id,
        )
    for name in ("template", "cpus", "memory_mib", "disk_mib"):
        ours, theirs = getattr(spec, name), getattr(snapshot, name)
        if ours != theirs:
            raise InvalidArgument(
                f"snapshot {snapshot.snapshot_id} has {name}={theirs!r}, the sandbox {ours!r}",
                sandbox_id=spec.sandbox_id,
            )
