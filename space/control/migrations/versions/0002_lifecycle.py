"""Sandbox lifecycle (issue 3): snapshots, idle timeouts, last activity, head snapshot.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision: str | None = "0001"
branch_labels: tuple[str, ...] | None = None
depends_on: tuple[str, ...] | None = None


def upgrade() -> None:
    # Nullable columns without defaults: a plain ADD COLUMN on SQLite and PostgreSQL.
    op.add_column("sandboxes", sa.Column("idle_timeout_s", sa.Integer(), nullable=True))
    op.add_column("sandboxes", sa.Column("last_active_at", sa.Float(), nullable=True))
    op.add_column("sandboxes", sa.Column("head_snapshot", sa.String(64), nullable=True))
    op.create_table(
        "snapshots",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("sandbox_id", sa.String(64), nullable=False),
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("parent_id", sa.String(64), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("deleted_at", sa.Float(), nullable=True),
        sa.Column("template", sa.String(128), nullable=False),
        sa.Column("cpus", sa.Integer(), nullable=False),
        sa.Column("memory_mib", sa.Integer(), nullable=False),
        sa.Column("disk_mib", sa.Integer(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_snapshots_tenant_id_tenants")
        ),
        sa.ForeignKeyConstraint(
            ["sandbox_id"], ["sandboxes.id"], name=op.f("fk_snapshots_sandbox_id_sandboxes")
        ),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], name=op.f("fk_snapshots_node_id_nodes")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_snapshots")),
    )
    op.create_index(op.f("ix_snapshots_node_id"), "snapshots", ["node_id"])
    op.create_index("ix_snapshots_tenant_sandbox", "snapshots", ["tenant_id", "sandbox_id"])


def downgrade() -> None:
    op.drop_table("snapshots")
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("head_snapshot")
        batch.drop_column("last_active_at")
        batch.drop_column("idle_timeout_s")
