"""Configuration of one control-plane replica."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from space.control.quotas import QuotaLimits
from space.node.api import InvalidArgument, PolicyBounds, host_addresses

__all__ = ["ControlSettings"]

_DOMAIN_RE = re.compile(
    r"(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
)


@dataclass(frozen=True)
class ControlSettings:
    """Where the control plane keeps its state.

    ``database_url`` defaults to SQLite in ``data_dir`` (``sqlite:///<data_dir>/space.db``);
    multi-replica deployments point every replica at the same PostgreSQL URL.
    ``node_token_path`` defaults to ``<data_dir>/node-token``: the shared secret node agents
    present to register and that the control plane presents to them (created 0600 on
    first start). ``default_timeout_s`` is a sandbox's lifetime when the request does not
    say; ``reaper_interval_s`` is how often a replica's background round runs (expired
    and idle sandboxes, node leases: space.control.background), ``reconcile_interval_s``
    how often every node is compared with the database, which leaves rows still being
    made (``creating``, pending snapshots) younger than ``reconcile_grace_s`` alone. A
    node's lease lasts ``node_lease_s`` from its last heartbeat; it is told to heartbeat
    every ``node_heartbeat_s``.
    ``master_key_file`` holds the master keys that wrap secrets' data keys (one base64
    key per line, the first current; space.control.secrets) unless SPACE_MASTER_KEY is
    set; it defaults to ``<data_dir>/master.key``, made 0600 on first start.
    ``quotas`` are every tenant's limits unless ``space quota set`` gave it its own
    (space.control.quotas).
    """

    data_dir: Path
    database_url: str = ""
    node_token_path: Path | None = None
    default_timeout_s: int = 300
    reaper_interval_s: float = 5.0
    reconcile_interval_s: float = 60.0
    reconcile_grace_s: float = 600.0
    node_lease_s: float = 30.0
    node_heartbeat_s: float = 5.0
    master_key_file: Path | None = None
    quotas: QuotaLimits = field(default_factory=QuotaLimits)
    #: What tenants' egress policies may name (issue 17): the same settings as the
    #: node's (space.node.core.config.NodeConfig), checked here at PUT and create.
    egress_operator_ranges: tuple[str, ...] = ()
    egress_allow_wide_any_port: bool = False
    #: The CA bundle node agents' https certificates are checked with (None: the
    #: system's); node agents served over plain http need none.
    node_ca_file: Path | None = None
    #: The domain sandboxes' ports are served under (issue 20): ``<port>-<id>.<domain>``
    #: reaches port ``port`` of sandbox ``id`` (wildcard DNS and TLS point it at the
    #: control plane). Empty: only the ``E2b-Sandbox-Id``/``-Port`` headers route.
    sandbox_domain: str = ""

    def __post_init__(self) -> None:
        _ = self.egress_bounds  # a bad operator range raises InvalidArgument here
        if self.sandbox_domain and not _DOMAIN_RE.fullmatch(self.sandbox_domain):
            raise InvalidArgument(
                f"sandbox domain {self.sandbox_domain[:100]!r} is not a DNS name"
                " (lower-case labels separated by dots)"
            )
        if not 0 < self.node_heartbeat_s < self.node_lease_s:
            raise InvalidArgument(
                f"a node's heartbeat interval ({self.node_heartbeat_s} s) must be positive "
                f"and shorter than its lease ({self.node_lease_s} s)"
            )
        # Frozen: fill the data_dir-derived defaults once, here.
        if not self.database_url:
            object.__setattr__(self, "database_url", f"sqlite:///{self.data_dir / 'space.db'}")
        if self.node_token_path is None:
            object.__setattr__(self, "node_token_path", self.data_dir / "node-token")
        if self.master_key_file is None:
            object.__setattr__(self, "master_key_file", self.data_dir / "master.key")

    @property
    def egress_bounds(self) -> PolicyBounds:
        """The bounds of tenants' policies, with this host's own addresses of now."""
        return PolicyBounds.of(
            self.egress_operator_ranges,
            allow_wide_any_port=self.egress_allow_wide_any_port,
            own_addresses=frozenset(host_addresses()),
        )

    @property
    def token_file(self) -> Path:
        """The node token's path (``node_token_path`` with its default resolved)."""
        return self.node_token_path or self.data_dir / "node-token"

    @property
    def key_file(self) -> Path:
        """The master key file's path (``master_key_file`` with its default resolved)."""
        return self.master_key_file or self.data_dir / "master.key"
