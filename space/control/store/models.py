"""SQLAlchemy models of the control plane's state.

Times are float seconds since the epoch (UTC), from the app's injected clock, so
expiry is a plain comparison on every database. The schema itself is created and
changed only by the Alembic migrations in space/control/migrations (a unit test keeps
models and migrations identical).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Text,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "ApiKeyRow",
    "Base",
    "IdempotencyKeyRow",
    "JobLeaseRow",
    "NodeRow",
    "SandboxRow",
    "SecretRow",
    "SnapshotRow",
    "TenantQuotaRow",
    "TenantRow",
]

# Deterministic constraint names, so later migrations can refer to them on any backend.
_NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=_NAMING)


class TenantRow(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[float] = mapped_column(Float)


class ApiKeyRow(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    #: The key's first characters, for display; never enough to authenticate.
    prefix: Mapped[str] = mapped_column(String(32))
    #: Hex SHA-256 of the whole key; the key itself is never stored.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class NodeRow(Base):
    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    #: The node agent's base URL, or "local" for the node embedded in the process.
    url: Mapped[str] = mapped_column(String(2048))
    last_seen: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: The node agent's boot id when every sandbox's secret grants were last sent to
    #: it (it holds them in memory only): another boot id means send them again.
    boot_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    #: ``active``, ``draining`` (no new sandboxes; its suspended ones move away) or
    #: ``lost`` (its lease ran out: no heartbeat in time).
    state: Mapped[str] = mapped_column(String(16), server_default="active")
    #: Renewed by each heartbeat; None: the node never heartbeat (an older node agent).
    lease_expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: What the node last reported (space.control.schemas.NodeCapacity), for placement.
    capacity: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class JobLeaseRow(Base):
    """Which control-plane replica runs a background job, until when (issue 19)."""

    __tablename__ = "job_leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[float] = mapped_column(Float)


class StaleArchiveRow(Base):
    """A bundle in the artifact store that no row names any more, to delete (issue 19)."""

    __tablename__ = "stale_archives"

    name: Mapped[str] = mapped_column(String(160), primary_key=True)


class SandboxRow(Base):
    __tablename__ = "sandboxes"
    __table_args__ = (Index("ix_sandboxes_tenant_state", "tenant_id", "state"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)
    template: Mapped[str] = mapped_column(String(128))
    cpus: Mapped[int] = mapped_column(Integer)
    memory_mib: Mapped[int] = mapped_column(Integer)
    disk_mib: Mapped[int] = mapped_column(Integer)
    env: Mapped[dict[str, Any]] = mapped_column(JSON)
    # "metadata" is reserved on declarative classes; the column keeps the API's name.
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    #: Observed state (space.node.api.interface.SandboxState values).
    state: Mapped[str] = mapped_column(String(16))
    #: What the control plane is driving towards: "running" or "deleted".
    desired_state: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    deleted_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: Seconds without guest activity after which the reaper hibernates it; None: never.
    idle_timeout_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: Last exec, process or file call (written at most once a second); None: none yet.
    last_active_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: The snapshot it last came from or took (as its node reports it).
    head_snapshot: Mapped[str | None] = mapped_column(String(64), nullable=True)
    #: Its egress policy (EgressPolicy.to_json, canonical), the desired state pushed to
    #: its node; None means no network at all.
    egress: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    #: Its secret bindings, ``[{"name", "placeholder", "env"}]`` (placeholders are not
    #: secret: the guest sees them); None: none.
    secrets: Mapped[list[dict[str, str]] | None] = mapped_column(JSON, nullable=True)
    #: The artifact store's bundle holding the sandbox as it is now (issue 19): named by
    #: its node once a hibernated sandbox's upload landed, cleared by any change.
    archive: Mapped[str | None] = mapped_column(String(160), nullable=True)
    #: Who may reach servers listening in it (issue 20, space.control.ports): "off",
    #: "token" (with its traffic token) or "public".
    ports: Mapped[str] = mapped_column(String(16), server_default="off")


class SecretRow(Base):
    """A tenant's secret, its value sealed (space.control.secrets): ``ciphertext`` is
    AES-256-GCM under a data key of its own, with ``nonce``; ``wrapped_key`` is that data
    key sealed under master key ``key_id`` (its own nonce first). Both are bound to
    (tenant_id, name), so a sealed value moved to another row does not open."""

    __tablename__ = "secrets"
    __table_args__ = (
        PrimaryKeyConstraint("tenant_id", "name"),
        ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
    )

    tenant_id: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(64))
    #: Domain patterns of the hosts the value may be sent to.
    hosts: Mapped[list[str]] = mapped_column(JSON)
    #: The environment variable holding the placeholder in its sandboxes.
    env: Mapped[str] = mapped_column(String(64))
    #: "placeholder" or "header"; ``header`` and ``format`` for "header".
    injection: Mapped[str] = mapped_column(String(16))
    header: Mapped[str | None] = mapped_column(String(64), nullable=True)
    format: Mapped[str] = mapped_column(Text)
    key_id: Mapped[str] = mapped_column(String(64))
    wrapped_key: Mapped[bytes] = mapped_column(LargeBinary)
    nonce: Mapped[bytes] = mapped_column(LargeBinary)
    ciphertext: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class SnapshotRow(Base):
    """A snapshot of a sandbox, kept on the node that took it.

    ``state`` is "pending" while the node makes it (never listed; reconciliation drops
    it if the node does not have it), "ready" once the node returned it, "deleting"
    once deletion was asked (not listed; the node deletion is retried) and "deleted".
    """

    __tablename__ = "snapshots"
    __table_args__ = (Index("ix_snapshots_tenant_sandbox", "tenant_id", "sandbox_id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    sandbox_id: Mapped[str] = mapped_column(ForeignKey("sandboxes.id"))
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    #: The snapshot this one was taken on top of (no foreign key: re-parented on delete).
    parent_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    state: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[float] = mapped_column(Float)
    deleted_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    template: Mapped[str] = mapped_column(String(128))
    cpus: Mapped[int] = mapped_column(Integer)
    memory_mib: Mapped[int] = mapped_column(Integer)
    disk_mib: Mapped[int] = mapped_column(Integer)
    # Saved RAM passes 2 GiB easily: 64-bit.
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    #: Whether the artifact store holds it, so it restores on any node (issue 19).
    archived: Mapped[bool] = mapped_column(Boolean, server_default=false(), default=False)


class TenantQuotaRow(Base):
    """A tenant's own limit of one quota (space.control.quotas), set by ``space quota
    set``; a quota without a row has the operator's default."""

    __tablename__ = "tenant_quotas"
    __table_args__ = (
        PrimaryKeyConstraint("tenant_id", "quota"),
        ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
    )

    tenant_id: Mapped[str] = mapped_column(String(64))
    #: A ``Quota.name``.
    quota: Mapped[str] = mapped_column(String(32))
    #: 64-bit: a disk limit in MiB may pass 2**31.
    limit: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[float] = mapped_column(Float)


class IdempotencyKeyRow(Base):
    """A create's or fork's ``Idempotency-Key`` (issue 19), inserted in the transaction
    that inserts the rows of the sandboxes it makes: ``sandbox_ids`` (in the order the
    answer lists them) and the SHA-256 of the request, which a retry must repeat."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (
        PrimaryKeyConstraint("tenant_id", "key"),
        ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
    )

    tenant_id: Mapped[str] = mapped_column(String(64))
    key: Mapped[str] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64))
    sandbox_ids: Mapped[list[str]] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)
    #: From then on the key is forgotten (swept by the reaper; a new request reuses it).
    expires_at: Mapped[float] = mapped_column(Float, index=True)
