"""The root broker's request set: all the node agent may ask of root (issue 18).

Each request is a frozen dataclass; ``encode`` makes its wire line and ``decode``
rebuilds it, checking every field against its declared type (str, int, bool, their
optional forms, lists of str, lists of str pairs, str-to-str dicts) and rejecting
unknown ops, unknown or missing fields and oversized values. What a request may name
(paths, namespaces, uids) is checked by the broker against its ``Scope``.

The set, by concern: the pool (mount, quotas, limits, sizes, subvolume deletion, send
and receive streams of subvolumes), each
sandbox's network namespace (make, remove, open or close egress, the gateway's
listeners), VMM jails (launch, release, sweep, signal), gVisor sandboxes (their
template trees and clones, launch or restore, pause, checkpoint, stop) and the egress
gateway (start, stop).
Answers are ``{"id", "ok": true, "value"}`` or ``{"id", "ok": false, "error": {"kind",
"message"}}``, ``kind`` a NodeError leaf's name, with descriptors (a listener pair)
on the answer's line.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

__all__ = [
    "MAX_LINE_BYTES",
    "AdoptPool",
    "AdoptReceived",
    "BindListeners",
    "CheckpointGvisor",
    "CloneGuestTree",
    "CreateNetns",
    "DeleteNetns",
    "DeleteSubvolume",
    "EnableQuotas",
    "ExclusiveBytes",
    "LaunchGvisor",
    "LaunchVm",
    "LimitSubvolume",
    "MakeGuestTree",
    "MountPool",
    "PauseGvisor",
    "ReceiveSubvolume",
    "ReferencedBytes",
    "ReleaseVm",
    "Request",
    "RequestError",
    "Scope",
    "SendSubvolume",
    "SetEgress",
    "SignalVm",
    "StartGateway",
    "StopGateways",
    "StopGvisor",
    "SweepVms",
    "UnmountPool",
    "decode",
    "encode",
]

#: A request line: a launch's argv and binds are the largest, a few KiB.
MAX_LINE_BYTES = 256 * 1024
_MAX_TEXT = 16 * 1024
_MAX_ITEMS = 512


class RequestError(ValueError):
    """A line that is not a well-formed request of the set."""


@dataclass(frozen=True, slots=True)
class Scope:
    """What one broker may touch, fixed when it starts: files under ``roots`` (the
    node's data dir, pool and run root), namespaces and cgroups of ``run_root``'s node;
    ``owner`` is the node agent's (uid, gid): what the broker makes for the agent is
    theirs, and what it hands to a jail or the gateway stays in the agent's group."""

    run_root: Path
    roots: tuple[Path, ...]
    owner: tuple[int, int] = (0, 0)

    def to_json(self) -> str:
        return json.dumps(
            {
                "run_root": str(self.run_root),
                "roots": [str(r) for r in self.roots],
                "owner": self.owner,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Scope:
        data = json.loads(text)
        uid, gid = data["owner"]
        return cls(
            Path(data["run_root"]), tuple(Path(r) for r in data["roots"]), (int(uid), int(gid))
        )


class Request:
    """A request of the set (``op`` names it on the wire)."""

    op: ClassVar[str]


# the pool


@dataclass(frozen=True, slots=True)
class MountPool(Request):
    """Loop-mount the btrfs image ``image`` (``mkfs`` first: a new file) on ``mountpoint``."""

    op: ClassVar[str] = "mount_pool"
    image: str
    mountpoint: str
    mkfs: bool


@dataclass(frozen=True, slots=True)
class UnmountPool(Request):
    """Unmount ``mountpoint`` and detach the loop devices of ``image``."""

    op: ClassVar[str] = "unmount_pool"
    image: str
    mountpoint: str


@dataclass(frozen=True, slots=True)
class AdoptPool(Request):
    """Make the pool at ``root`` the node agent's: what root owns becomes the agent's,
    what a jail was handed joins the agent's group (a pool made while the agent ran
    as root); read-only subvolumes are changed too. Idempotent."""

    op: ClassVar[str] = "adopt_pool"
    root: str


@dataclass(frozen=True, slots=True)
class EnableQuotas(Request):
    op: ClassVar[str] = "enable_quotas"
    root: str


@dataclass(frozen=True, slots=True)
class LimitSubvolume(Request):
    op: ClassVar[str] = "limit_subvolume"
    path: str
    max_referenced: int


@dataclass(frozen=True, slots=True)
class ReferencedBytes(Request):
    op: ClassVar[str] = "referenced_bytes"
    path: str


@dataclass(frozen=True, slots=True)
class ExclusiveBytes(Request):
    op: ClassVar[str] = "exclusive_bytes"
    path: str


@dataclass(frozen=True, slots=True)
class DeleteSubvolume(Request):
    op: ClassVar[str] = "delete_subvolume"
    path: str


@dataclass(frozen=True, slots=True)
class SendSubvolume(Request):
    """Write the btrfs send stream of the read-only subvolume ``path`` (incremental
    against the read-only subvolume ``parent``) into the pipe on the request's line;
    answered once all of it is written (issue 19)."""

    op: ClassVar[str] = "send_subvolume"
    path: str
    parent: str | None


@dataclass(frozen=True, slots=True)
class ReceiveSubvolume(Request):
    """``btrfs receive`` the send stream read from the pipe on the request's line into
    the empty directory ``directory`` of the pool ``pool``, at most ``max_bytes`` of
    it; the value is ``{"name", "stream_bytes", "sha256"}`` of the one read-only
    subvolume received. A refused stream leaves nothing (issue 19)."""

    op: ClassVar[str] = "receive_subvolume"
    pool: str
    directory: str
    max_bytes: int


@dataclass(frozen=True, slots=True)
class AdoptReceived(Request):
    """Make the received subvolume ``path`` the agent's (``writable``: a sandbox's
    volume; else it stays read-only, a parent for later streams; ``guest_tree``: a
    gVisor sandbox's, whose guest root directory stays as received)."""

    op: ClassVar[str] = "adopt_received"
    path: str
    writable: bool
    guest_tree: bool = False


# network namespaces


@dataclass(frozen=True, slots=True)
class CreateNetns(Request):
    """Make the namespace ``name`` with its tap (``veth``: a gVisor guest's veth pair
    and second namespace) and egress closed; a no-op if it exists."""

    op: ClassVar[str] = "create_netns"
    name: str
    veth: bool = False


@dataclass(frozen=True, slots=True)
class DeleteNetns(Request):
    op: ClassVar[str] = "delete_netns"
    name: str


@dataclass(frozen=True, slots=True)
class SetEgress(Request):
    op: ClassVar[str] = "set_egress"
    name: str
    open: bool


@dataclass(frozen=True, slots=True)
class BindListeners(Request):
    """The gateway's TCP and UDP listeners in ``name``: two descriptors on the answer."""

    op: ClassVar[str] = "bind_listeners"
    name: str


# VMM jails


@dataclass(frozen=True, slots=True)
class LaunchVm(Request):
    """Start ``argv`` jailed as the VM ``name`` (its run directory's name); the value
    is its host pid. ``binds`` are (path, ro|rw) pairs; ``owned`` are handed to the
    jail's uid first; ``secrets`` become files under the jail's /secrets."""

    op: ClassVar[str] = "launch_vm"
    name: str
    argv: list[str]
    binds: list[tuple[str, str]]
    owned: list[str]
    netns: str | None
    tap: str
    memory_mib: int
    cpus: int
    stderr_log: str
    pid_file: str
    secrets: dict[str, str]


@dataclass(frozen=True, slots=True)
class ReleaseVm(Request):
    """The VM ``name`` has exited: remove its cgroups."""

    op: ClassVar[str] = "release_vm"
    name: str


@dataclass(frozen=True, slots=True)
class SweepVms(Request):
    """Remove the cgroups VMMs that exited while no node watched left."""

    op: ClassVar[str] = "sweep_vms"


@dataclass(frozen=True, slots=True)
class SignalVm(Request):
    """Send ``signal`` to the jailed VMM serving the run directory ``run_dir``, named by
    the pidfd on the request's line."""

    op: ClassVar[str] = "signal_vm"
    run_dir: str
    signal: int


# gVisor sandboxes (issue 21)


@dataclass(frozen=True, slots=True)
class MakeGuestTree(Request):
    """Unpack the plain ext4 guest image open as the descriptor on the request's line
    into the subvolume ``path`` (a directory tree, root's, for gVisor sandboxes); a
    no-op if it exists."""

    op: ClassVar[str] = "make_guest_tree"
    path: str


def unpacking_name(tree: str) -> str:
    """The name of root's scratch directory beside the tree named ``tree`` while it is
    unpacked (``MakeGuestTree``); one an unpacking cut short leaves behind."""
    return f".{tree}.unpacking"


@dataclass(frozen=True, slots=True)
class CloneGuestTree(Request):
    """Make the subvolume ``volume`` (absent) a writable snapshot of the tree ``tree``."""

    op: ClassVar[str] = "clone_guest_tree"
    tree: str
    volume: str


@dataclass(frozen=True, slots=True)
class LaunchGvisor(Request):
    """Start the gVisor sandbox ``name`` on the root filesystem ``volume``, its init's
    stdin and stdout the socket on the request's line, in ``netns`` (None: no network
    at all); runsc's output goes to ``log``. With ``restore`` it is restored from the
    saved state streamed on the line's second descriptor (a pipe or a file) instead of
    booted. The value is its runsc sandbox's pid."""

    op: ClassVar[str] = "launch_gvisor"
    name: str
    volume: str
    netns: str | None
    hostname: str
    memory_mib: int
    cpus: int
    log: str
    restore: bool = False
    #: gVisor's network stack on the guest's link in the second namespace of
    #: ``netns`` (runsc ``--network=sandbox``) instead of loopback only.
    networked: bool = False


@dataclass(frozen=True, slots=True)
class PauseGvisor(Request):
    """Pause (``paused``) or resume the gVisor sandbox ``name``'s tasks."""

    op: ClassVar[str] = "pause_gvisor"
    name: str
    paused: bool


@dataclass(frozen=True, slots=True)
class CheckpointGvisor(Request):
    """Save the gVisor sandbox ``name``'s state into the descriptor on the request's
    line (a pipe or a file); the sandbox stays as it was (running or paused). The
    value is the state's size in bytes."""

    op: ClassVar[str] = "checkpoint_gvisor"
    name: str


@dataclass(frozen=True, slots=True)
class StopGvisor(Request):
    """Kill the gVisor sandbox ``name`` and remove runsc's state of it; idempotent."""

    op: ClassVar[str] = "stop_gvisor"
    name: str


# the egress gateway


@dataclass(frozen=True, slots=True)
class StartGateway(Request):
    """Start the gateway, unprivileged, in ``directory`` (its uid's, with the trees
    named in ``state``) with ``options``; copy ``upstream_ca`` in for it. Returns once
    it is forked off."""

    op: ClassVar[str] = "start_gateway"
    directory: str
    state: list[str]
    options: list[str]
    upstream_ca: str | None
    environment: dict[str, str]


@dataclass(frozen=True, slots=True)
class StopGateways(Request):
    """Kill every gateway running in ``directory``."""

    op: ClassVar[str] = "stop_gateways"
    directory: str


_REQUESTS: dict[str, type[Request]] = {
    cls.op: cls
    for cls in (
        MountPool, UnmountPool, AdoptPool, EnableQuotas, LimitSubvolume, ReferencedBytes,
        ExclusiveBytes, DeleteSubvolume, SendSubvolume, ReceiveSubvolume, AdoptReceived,
        CreateNetns, DeleteNetns, SetEgress,
        BindListeners, LaunchVm, ReleaseVm, SweepVms, SignalVm, StartGateway, StopGateways,
        MakeGuestTree, CloneGuestTree, LaunchGvisor, PauseGvisor, CheckpointGvisor,
        StopGvisor,
    )
}  # fmt: skip


def encode(request_id: int, request: Request) -> bytes:
    """The request's wire line (newline included)."""
    body = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}  # type: ignore[arg-type]
    return json.dumps({"id": request_id, "op": request.op, "args": body}).encode() + b"\n"


def decode(line: bytes) -> tuple[int, Request]:
    """The id and request of a wire line. Raises RequestError for anything else."""
    if len(line) > MAX_LINE_BYTES:
        raise RequestError(f"a request is over {MAX_LINE_BYTES} bytes")
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise RequestError(f"not JSON: {exc}") from exc
    if not isinstance(message, dict) or set(message) != {"id", "op", "args"}:
        raise RequestError("a request is {id, op, args}")
    request_id, op, args = message["id"], message["op"], message["args"]
    if type(request_id) is not int or not isinstance(args, dict):
        raise RequestError("a request's id is an integer and its args an object")
    cls = _REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise RequestError(f"unknown request {op!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if set(args) != fields:
        raise RequestError(f"{op} takes {sorted(fields)}, got {sorted(args)}")
    checked = {name: _check(f"{op}.{name}", hints[name], value) for name, value in args.items()}
    return request_id, cls(**checked)


def _check(where: str, kind: object, value: object) -> object:
    """``value`` as ``kind`` (JSON lists become the declared tuples); RequestError if not."""
    if isinstance(kind, types.UnionType):  # X | None
        if value is None:
            return None
        (kind,) = [k for k in typing.get_args(kind) if k is not type(None)]
    origin, params = typing.get_origin(kind), typing.get_args(kind)
    if kind in (str, int, bool):
        if type(value) is not kind:
            raise RequestError(f"{where}: want {kind.__name__}")
        if isinstance(value, str) and (len(value) > _MAX_TEXT or "\0" in value):
            raise RequestError(f"{where}: a string over {_MAX_TEXT} characters or with NUL")
        return value
    if origin is list and isinstance(value, list) and len(value) <= _MAX_ITEMS:
        return [_check(f"{where}[]", params[0], item) for item in value]
    if origin is tuple and isinstance(value, list) and len(value) == len(params):
        return tuple(_check(f"{where}[]", k, item) for k, item in zip(params, value, strict=True))
    if origin is dict and isinstance(value, dict) and len(value) <= _MAX_ITEMS:
        return {_check(where, str, k): _check(f"{where}[]", str, v) for k, v in value.items()}
    raise RequestError(f"{where}: want {kind}")
