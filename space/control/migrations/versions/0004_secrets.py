"""Secrets (issue 5): the tenants' sealed secrets, sandboxes' bindings, nodes' boot ids.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision: str | None = "0003"
branch_labels: tuple[str, ...] | None = None
depends_on: tuple[str, ...] | None = None


def upgrade() -> None:
    op.create_table(
        "secrets",
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("hosts", sa.JSON(), nullable=False),
        sa.Column("env", sa.String(64), nullable=False),
        sa.Column("injection", sa.String(16), nullable=False),
        sa.Column("header", sa.String(64), nullable=True),
        sa.Column("format", sa.Text(), nullable=False),
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("wrapped_key", sa.LargeBinary(), nullable=False),
        sa.Column("nonce", sa.LargeBinary(), nullable=False),
        sa.Column("ciphertext", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_secrets_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("tenant_id", "name", name=op.f("pk_secrets")),
    )
    # Nullable without defaults: a plain ADD COLUMN everywhere. A sandbox made before
    # secrets has none; a node never synced has no boot id (its grants are sent).
    op.add_column("sandboxes", sa.Column("secrets", sa.JSON(), nullable=True))
    op.add_column("nodes", sa.Column("boot_id", sa.String(256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("boot_id")
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("secrets")
    op.drop_table("secrets")
