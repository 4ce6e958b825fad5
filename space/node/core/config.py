"""Configuration of one node agent.

``NodeConfig`` is a plain frozen value; nothing here starts processes. The only side
effect is ``resolve_node_id``, which persists a generated node id in the data dir so it
stays stable across restarts.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from space.limits import (
    DEFAULT_BUILD_CACHE_GIB,
    DEFAULT_BUILD_SLOTS,
    DEFAULT_MEMORY_OVERCOMMIT,
    DEFAULT_POOL_SIZE_GIB,
)
from space.node.api import GUEST_TYPES, InvalidArgument, PolicyBounds
from space.node.core.capacity import Policy
from space.node.network.resolvers import parse_resolvers, system_resolvers

__all__ = ["Accel", "ArtifactStoreConfig", "NodeConfig", "resolve_node_id"]

Accel = Literal["auto", "kvm", "tcg"]

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")  # S3's bucket naming rules
_REGION_RE = re.compile(r"^[a-z0-9-]{1,32}$")
_NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
#: The Debian release of the guest image (space/node/images/_rootfs.py) and its updates.
DEFAULT_APT_SOURCES = (
    f"deb [signed-by={_KEYRING}] http://deb.debian.org/debian bookworm main",
    f"deb [signed-by={_KEYRING}] http://deb.debian.org/debian bookworm-updates main",
    f"deb [signed-by={_KEYRING}] http://deb.debian.org/debian-security bookworm-security main",
)


@dataclass(frozen=True)
class ArtifactStoreConfig:
    """Where snapshots and hibernated sandboxes may be kept off the node (issue 19;
    space.node.artifacts): ``kind`` "fs" takes ``path`` (a directory, e.g. a shared
    mount), "s3" takes ``s3_bucket`` and optionally ``s3_endpoint_url`` (None: AWS),
    ``s3_region`` and ``s3_credentials_file`` (an owner-only file of two lines, the
    access key id then the secret key; None: boto3's own chain, e.g. the environment).
    Settings of the other kind must stay unset, so a typo is not silently ignored.
    """

    kind: Literal["fs", "s3"]
    path: Path | None = None
    s3_endpoint_url: str | None = None
    s3_bucket: str | None = None
    s3_region: str = "us-east-1"
    s3_credentials_file: Path | None = None
    #: Multipart upload part size (S3 takes 5 MiB to 5 GiB; 8 MiB is boto3's default).
    s3_part_mib: int = 8
    #: The largest object the node stores (a disk stream of a big sandbox fits).
    max_object_gib: int = 256

    def __post_init__(self) -> None:
        if self.kind == "fs":
            self._check_fs()
        elif self.kind == "s3":
            self._check_s3()
        else:
            raise InvalidArgument(f"artifact store kind must be 'fs' or 's3', got {self.kind!r}")
        size = self.max_object_gib
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidArgument(f"artifact store max_object_gib must be >= 1, got {size!r}")

    def _check_fs(self) -> None:
        if not isinstance(self.path, Path) or not self.path.is_absolute():
            raise InvalidArgument(
                f"an 'fs' artifact store needs an absolute path, got {self.path!r}"
            )
        if self.s3_endpoint_url or self.s3_bucket or self.s3_credentials_file:
            raise InvalidArgument("an 'fs' artifact store takes no s3_* settings")

    def _check_s3(self) -> None:
        if self.path is not None:
            raise InvalidArgument("an 's3' artifact store takes no path")
        if not isinstance(self.s3_bucket, str) or not _BUCKET_RE.match(self.s3_bucket):
            raise InvalidArgument(
                f"an 's3' artifact store needs a bucket name (3-63 of a-z 0-9 . -),"
                f" got {self.s3_bucket!r}"
            )
        url = self.s3_endpoint_url
        if url is not None and not re.match(r"^https?://[^/\s]+/?$", url):
            raise InvalidArgument(f"s3_endpoint_url must be http(s)://host[:port], got {url!r}")
        if not isinstance(self.s3_region, str) or not _REGION_RE.match(self.s3_region):
            raise InvalidArgument(f"s3_region must be like us-east-1, got {self.s3_region!r}")
        part = self.s3_part_mib
        if not isinstance(part, int) or isinstance(part, bool) or not 5 <= part <= 5120:
            raise InvalidArgument(f"s3_part_mib must be in 5..5120, got {part!r}")


@dataclass(frozen=True)
class NodeConfig:
    """Where a node keeps its state and how it runs VMs.

    ``pool_path`` is an existing btrfs mount to use; None means a loop-mounted file
    ``data_dir/pool.img`` of ``pool_size_gib`` (sparse) mounted at ``data_dir/pool``.
    ``node_id`` None means: generated once and persisted in ``data_dir/node_id``.
    ``run_dir`` holds the VMs' unix sockets and pid files; None means a short path under
    /run/space derived from ``data_dir`` (unix socket paths are limited to 107 bytes, so
    sockets cannot live under an arbitrarily deep data dir).
    """

    data_dir: Path = Path("/var/lib/space")
    pool_path: Path | None = None
    pool_size_gib: int = DEFAULT_POOL_SIZE_GIB
    image_cache_dir: Path = Path("/var/cache/space/images")
    accel: Accel = "auto"
    node_id: str | None = None
    #: Admission by capacity (space/node/core/capacity.py has the formula): host memory
    #: kept from sandboxes, the most memory the live VMs may grow to as a multiple of
    #: the rest, pool space kept free (None: the defaults of space/limits.py, relative
    #: to the host's memory and the pool's size), and an optional cap on sandboxes.
    memory_reserve_mib: int | None = None
    memory_overcommit: float = DEFAULT_MEMORY_OVERCOMMIT
    pool_reserve_mib: int | None = None
    max_sandboxes: int | None = None
    boot_timeout_s: float = 60.0
    run_dir: Path | None = None
    qemu_binary: str = "qemu-system-x86_64"
    #: The guest type a sandbox asking for ``auto`` gets where KVM does not work
    #: (issue 21; with KVM, ``auto`` is always ``qemu``): ``qemu`` (TCG: slow, a kernel
    #: of its own) or ``gvisor`` (fast, gVisor's application kernel on the host's).
    guest_without_kvm: str = "qemu"
    #: Bytes of serial console kept per sandbox (older output is rotated away).
    console_max_bytes: int = 1 << 20
    #: Make each template's ready state at start (one boot, then kept in the pool), so
    #: sandboxes of its shape start from memory instead of booting.
    ready_state: bool = True
    #: Warm pool per template (needs its ready state): paused VMs woken from it, handed
    #: out on create. The pool follows recent demand between these sizes; 0 and 0 (the
    #: default) means no pool. Each waiting VM holds its RAM but no CPU.
    warm_pool_min: int = 0
    warm_pool_max: int = 0
    #: VMs started (booted or woken from memory) at once; more creates wait their turn.
    max_parallel_starts: int = 4
    #: Template builds run at once (each in its own build VM, admitted like any VM),
    #: shared fairly between tenants; and how many more of one tenant's builds may wait
    #: for a slot before the next is refused (space/node/agent/_build_slots.py).
    build_slots: int = DEFAULT_BUILD_SLOTS
    queued_builds_per_tenant: int = 4
    #: Longest a template build's run step or package install may take.
    build_step_timeout_s: float = 1800.0
    #: Where template builds fetch packages from (apt one-line sources; the host
    #: fetches, the build VM has no network).
    apt_sources: tuple[str, ...] = DEFAULT_APT_SOURCES
    #: Where finished build layers are kept across pools, by content (None: nowhere);
    #: see space/node/agent/_build_cache.py. The node's user must be able to write it.
    build_cache_dir: Path | None = None
    #: Most GiB of layers kept there; past it, the least recently used entries go.
    build_cache_gib: float = DEFAULT_BUILD_CACHE_GIB
    #: DNS servers ("address" or "address:port", IPv4) the egress gateway resolves
    #: allowed names with; empty means the host's /etc/resolv.conf nameservers.
    egress_resolvers: tuple[str, ...] = ()
    #: CA bundle the egress gateway verifies upstream TLS servers with; None means the
    #: host's (/etc/ssl/certs/ca-certificates.crt). Upstream TLS is always verified.
    egress_upstream_ca: Path | None = None
    #: Networks inside private, CGNAT, ULA or link-local ranges that tenants' egress
    #: policies may name (issue 17); none by default. Whether a rule wider than /8 may
    #: carry ports beyond 80 and 443. (space.node.api.egress_policy.PolicyBounds.)
    egress_operator_ranges: tuple[str, ...] = ()
    egress_allow_wide_any_port: bool = False
    #: CA bundle this node verifies other nodes' TLS certificates with when it pulls a
    #: moved sandbox from them (issue 19); None means the system's.
    peer_ca_file: Path | None = None
    #: The node key's file (space/node/core/keys.py); None means ``data_dir/node.key``.
    key_file: Path | None = None
    #: The off-node artifact store (None: none; nothing is wired to it yet, issue 19).
    artifact_store: ArtifactStoreConfig | None = None
    #: The artifact store's master key, the same file on every node of a cluster (made
    #: at first use if absent, then copied to the others); None: ``data_dir/artifact.key``.
    artifact_key_file: Path | None = None

    def __post_init__(self) -> None:
        self._check_counts()
        if self.guest_without_kvm not in GUEST_TYPES:
            raise InvalidArgument(
                f"guest_without_kvm must be one of {', '.join(GUEST_TYPES)}, "
                f"got {self.guest_without_kvm!r}"
            )
        _ = self.egress_bounds  # a bad operator range raises InvalidArgument here
        ratio = self.memory_overcommit
        if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0 < ratio <= 100:
            raise InvalidArgument(
                f"memory_overcommit must be a number above 0 and at most 100, got {ratio!r}"
            )
        try:
            parse_resolvers(self.egress_resolvers)
        except ValueError as exc:
            raise InvalidArgument(f"egress_resolvers: {exc}") from exc
        store = self.artifact_store
        if store is not None and not isinstance(store, ArtifactStoreConfig):
            raise InvalidArgument(f"artifact_store must be an ArtifactStoreConfig, got {store!r}")
        if not all(isinstance(line, str) and line.startswith("deb ") for line in self.apt_sources):
            raise InvalidArgument(
                f"apt_sources must be one-line 'deb ...' sources: {self.apt_sources!r}"
            )

    def _check_counts(self) -> None:
        """Each count a whole number (not a bool) of at least its least; the optional
        ones (None: unset) too when set."""
        counts = {
            "max_sandboxes": (self.max_sandboxes, 1),
            "memory_reserve_mib": (self.memory_reserve_mib, 0),
            "pool_reserve_mib": (self.pool_reserve_mib, 0),
            "max_parallel_starts": (self.max_parallel_starts, 1),
            "build_slots": (self.build_slots, 1),
            "queued_builds_per_tenant": (self.queued_builds_per_tenant, 0),
            "warm_pool_min": (self.warm_pool_min, 0),
            "warm_pool_max": (self.warm_pool_max, self.warm_pool_min),
        }
        optional = {"max_sandboxes", "memory_reserve_mib", "pool_reserve_mib"}
        for name, (value, least) in counts.items():
            if value is None and name in optional:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise InvalidArgument(
                    f"{name} must be an integer of at least {least}, got {value!r}"
                )

    @property
    def egress_bounds(self) -> PolicyBounds:
        """What tenants' egress policies may name on this node."""
        return PolicyBounds.of(
            self.egress_operator_ranges, allow_wide_any_port=self.egress_allow_wide_any_port
        )

    @property
    def capacity(self) -> Policy:
        """The admission settings, for space.node.core.capacity."""
        return Policy(
            memory_reserve_mib=self.memory_reserve_mib,
            memory_overcommit=self.memory_overcommit,
            pool_reserve_mib=self.pool_reserve_mib,
            max_sandboxes=self.max_sandboxes,
        )

    @property
    def effective_run_dir(self) -> Path:
        """The directory for sockets and pid files (see the class docstring)."""
        if self.run_dir is not None:
            return self.run_dir
        tag = hashlib.sha256(str(self.data_dir.resolve()).encode()).hexdigest()[:12]
        return Path("/run/space") / tag

    @property
    def effective_key_file(self) -> Path:
        return self.key_file if self.key_file is not None else self.data_dir / "node.key"

    @property
    def effective_artifact_key_file(self) -> Path:
        if self.artifact_key_file is not None:
            return self.artifact_key_file
        return self.data_dir / "artifact.key"

    @property
    def effective_upstream_ca(self) -> Path:
        return self.egress_upstream_ca or Path("/etc/ssl/certs/ca-certificates.crt")

    @property
    def effective_resolvers(self) -> list[str]:
        return list(self.egress_resolvers) or system_resolvers()

    @property
    def effective_pool_path(self) -> Path:
        return self.pool_path if self.pool_path is not None else self.data_dir / "pool"


def resolve_node_id(config: NodeConfig) -> str:
    """Return the configured node id, else the one persisted in the data dir.

    Creates ``data_dir`` and ``data_dir/node_id`` on first use. Raises ValueError for a
    configured id that is not a short path-safe token.
    """
    if config.node_id is not None:
        if not _NODE_ID_RE.match(config.node_id):
            raise ValueError(f"invalid node id {config.node_id!r}")
        return config.node_id
    path = config.data_dir / "node_id"
    try:
        stored = path.read_text().strip()
        if _NODE_ID_RE.match(stored):
            return stored
    except FileNotFoundError:
        pass
    config.data_dir.mkdir(parents=True, exist_ok=True)
    node_id = "node-" + secrets.token_hex(6)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(node_id + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return node_id
