"""The limits of SPACE's contract, written once: the node checks them, the REST schemas
and template specs enforce them, the SDK and CLI check them before sending.

Stdlib only and importing nothing, so every layer (and the SDK installed alone) may use
it. Changing a number here changes it everywhere; docs/api.md states the same values.
"""

from __future__ import annotations

from typing import Final, NamedTuple

__all__ = [
    "CPUS",
    "DEFAULT_BUILD_CACHE_GIB",
    "DEFAULT_BUILD_SLOTS",
    "DEFAULT_CPUS",
    "DEFAULT_DISK_MIB",
    "DEFAULT_MEMORY_MIB",
    "DEFAULT_MEMORY_OVERCOMMIT",
    "DEFAULT_POOL_SIZE_GIB",
    "DISK_MIB",
    "ENV",
    "IDEMPOTENCY_KEY_CHARS",
    "IDEMPOTENCY_KEY_TTL_S",
    "MAX_COMMAND_TIMEOUT_S",
    "MAX_EGRESS_LOG_EVENTS",
    "MAX_FORK_CHILDREN",
    "MAX_IDLE_TIMEOUT_S",
    "MAX_JSON_BODY_BYTES",
    "MAX_LIFETIME_S",
    "MAX_PROCESS_PID",
    "MAX_PTY_SIZE",
    "MAX_SANDBOX_SECRETS",
    "MAX_STDIN_BYTES",
    "MAX_TIMEOUT_S",
    "MEMORY_MIB",
    "MEMORY_RESERVE_MIB",
    "MEMORY_RESERVE_SHARE",
    "METADATA",
    "POOL_RESERVE_MIB",
    "POOL_RESERVE_SHARE",
    "PROCESS_TAG_PATTERN",
    "QUOTAS",
    "RESOURCES",
    "MapLimit",
    "Quota",
    "Range",
]


class Range(NamedTuple):
    """An inclusive range of whole numbers."""

    low: int
    high: int

    def holds(self, value: object) -> bool:
        """Whether ``value`` is a whole number (not a bool) in the range."""
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and self.low <= value <= self.high
        )

    def clamp(self, value: int) -> int:
        """``value`` moved into the range."""
        return min(max(value, self.low), self.high)

    def refusal(self, name: str, value: object) -> str | None:
        """Why ``value`` cannot be ``name`` (the one wording every layer uses), or None."""
        if self.holds(value):
            return None
        return f"{name} must be within {self.low}..{self.high}, got {value!r}"


class MapLimit(NamedTuple):
    """Bounds of a map of strings (a sandbox's ``env`` or ``metadata``): most entries,
    longest key and value (UTF-8 bytes), and most bytes of keys and values together.
    ``env_names`` also refuses a key holding ``=`` (an environment name cannot)."""

    entries: int
    key_bytes: int
    value_bytes: int
    total_bytes: int
    env_names: bool = False

    def refusal(self, name: str, value: object) -> str | None:
        """Why ``value`` cannot be ``name`` (the one wording every layer uses), or None."""
        if not isinstance(value, dict):
            return f"{name} must be an object of strings"
        if len(value) > self.entries:
            return f"{name} has {len(value)} entries; at most {self.entries} are allowed"
        total = 0
        for key, item in value.items():
            why = self._entry_refusal(key, item)
            if why is not None:
                return f"{name}[{str(key)[:64]!r}] {why}"
            total += len(key.encode()) + len(item.encode())
        if total > self.total_bytes:
            return f"{name} holds {total} bytes; at most {self.total_bytes} are allowed"
        return None

    def _entry_refusal(self, key: object, item: object) -> str | None:
        if not isinstance(key, str) or not isinstance(item, str):
            return "must map a string to a string"
        if not key or "\0" in key or (self.env_names and "=" in key):
            forbidden = "NUL or '='" if self.env_names else "NUL"
            return f"must be named by a non-empty string without {forbidden}"
        if "\0" in item:
            return "must not hold NUL"
        try:
            key_bytes, item_bytes = len(key.encode()), len(item.encode())
        except UnicodeEncodeError:
            return "must be valid UTF-8"
        if key_bytes > self.key_bytes:
            return f"name is {key_bytes} bytes; at most {self.key_bytes} are allowed"
        if item_bytes > self.value_bytes:
            return f"is {item_bytes} bytes; at most {self.value_bytes} are allowed"
        return None


#: Most bytes of a JSON request body (issue 17: a body is refused at this size, 413,
#: before it is read whole). File uploads and template build contexts stream instead and
#: have their own caps.
MAX_JSON_BODY_BYTES: Final = 1 << 20

#: A sandbox's environment (at create) and an exec's (added to it). Both reach the guest
#: in one exec request, whose JSON the guest protocol caps at 64 KiB
#: (space/protocol/_messages.py MAX_JSON_BYTES): 24 KiB each leaves room for the command.
ENV: Final = MapLimit(
    entries=256, key_bytes=256, value_bytes=16 * 1024, total_bytes=24 * 1024, env_names=True
)
#: A sandbox's metadata: labels kept in its row and answered in every listing.
METADATA: Final = MapLimit(entries=64, key_bytes=128, value_bytes=1024, total_bytes=16 * 1024)

#: A sandbox's (or a template's) resources.
CPUS: Final = Range(1, 8)
MEMORY_MIB: Final = Range(128, 16384)
DISK_MIB: Final = Range(1024, 65536)
RESOURCES: Final = {"cpus": CPUS, "memory_mib": MEMORY_MIB, "disk_mib": DISK_MIB}
#: What a create that names no resources (and a template that sets none) gets.
DEFAULT_CPUS: Final = 1
DEFAULT_MEMORY_MIB: Final = 256
DEFAULT_DISK_MIB: Final = 2048

#: Most children one fork makes (each is a VM: the node's capacity bounds it too).
MAX_FORK_CHILDREN: Final = 16
#: An ``Idempotency-Key`` of a create or fork (issue 19): 1 to 255 printable ASCII
#: characters (Stripe's bound), remembered for a day after the request that made it.
IDEMPOTENCY_KEY_CHARS: Final = Range(1, 255)
IDEMPOTENCY_KEY_TTL_S: Final = 24 * 3600
#: Most secrets one sandbox may use.
MAX_SANDBOX_SECRETS: Final = 64
#: Most egress decisions one read of a sandbox's audit log returns.
MAX_EGRESS_LOG_EVENTS: Final = 1000

#: A sandbox's lifetime given at create (a day), and set later (30 days).
MAX_TIMEOUT_S: Final = 24 * 3600
MAX_LIFETIME_S: Final = 30 * 24 * 3600
#: Seconds without activity before a sandbox hibernates (a week at most).
MAX_IDLE_TIMEOUT_S: Final = 7 * 24 * 3600
#: Longest a command may run (a day).
MAX_COMMAND_TIMEOUT_S: Final = 24 * 3600
#: Interactive processes (issue 20), the guest protocol's own numbers (space.protocol
#: MAX_INPUT_BYTES, MAX_PTY_SIZE, TAG_PATTERN, MAX_PID; a unit test keeps them equal):
#: stdin bytes per call, rows and columns of a PTY (1 to this), a process tag, the
#: largest pid a process is found by.
MAX_STDIN_BYTES: Final = 1 << 20
MAX_PTY_SIZE: Final = 1000
PROCESS_TAG_PATTERN: Final = r"[A-Za-z0-9_.:-]{1,64}"
MAX_PROCESS_PID: Final = 4 * 1024 * 1024

#: A node's admission by capacity (issue 15; space/node/core/capacity.py has the formula
#: and why these defaults). Host memory no sandbox may take: this share of MemTotal,
#: within these MiB, unless the operator sets it.
MEMORY_RESERVE_SHARE: Final = 0.10
MEMORY_RESERVE_MIB: Final = Range(1024, 8192)
#: Most memory the live VMs may grow to (guest RAM plus QEMU's overhead, summed), as a
#: multiple of the host's memory less the reserve.
DEFAULT_MEMORY_OVERCOMMIT: Final = 2.0
#: Space kept free in the node's btrfs pool: this share of its size, within these MiB.
POOL_RESERVE_SHARE: Final = 0.10
POOL_RESERVE_MIB: Final = Range(1024, 32768)
#: The size of the sparse loop file a node makes its btrfs pool in when the operator
#: names no btrfs mount. Disks are thin, but admission keeps room for every running
#: sandbox's saved state, so this bounds the sandboxes a node admits (issue 17).
DEFAULT_POOL_SIZE_GIB: Final = 20
#: Template builds a node runs at once unless the operator sets it (issue 17): each in
#: its own build VM, shared fairly between tenants (space/node/agent/_build_slots.py).
DEFAULT_BUILD_SLOTS: Final = 2
#: Most GiB of layers a node's build cache (``--build-cache``) keeps unless the operator
#: sets it: the least recently used go first (space/node/agent/_build_cache.py).
DEFAULT_BUILD_CACHE_GIB: Final = 20


class Quota(NamedTuple):
    """A per-tenant limit (issue 17): ``name`` on the wire (``GET /v1/quota``, a 429's
    ``details.quota``), in config and, as ``option``, on the command line; what it
    ``counts``, in ``unit``. Its limits are the operator's (space.control.quotas)."""

    name: str
    unit: str
    counts: str

    @property
    def option(self) -> str:
        """Its command-line option, e.g. ``--running-sandboxes``."""
        return "--" + self.name.replace("_", "-")


#: Every per-tenant quota, in the order they are shown.
QUOTAS: Final = (
    Quota("running_sandboxes", "sandboxes", "sandboxes creating, running or paused"),
    Quota("suspended_sandboxes", "sandboxes", "sandboxes hibernated or stopped"),
    Quota("vcpus", "vCPUs", "vCPUs of the running sandboxes"),
    Quota("memory_mib", "MiB", "memory of the running sandboxes"),
    Quota("disk_mib", "MiB", "disk of the running and suspended sandboxes"),
    Quota("snapshots", "snapshots", "snapshots being taken or listed"),
    Quota("templates", "templates", "name:tag pairs of the tenant's own templates"),
    Quota("builds", "builds", "template builds in flight"),
)
