"""Quotas (issue 17): each tenant's own limits, where they differ from the defaults.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision: str | None = "0004"
branch_labels: tuple[str, ...] | None = None
depends_on: tuple[str, ...] | None = None


def upgrade() -> None:
    op.create_table(
        "tenant_quotas",
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("quota", sa.String(32), nullable=False),
        sa.Column("limit", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_tenant_quotas_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("tenant_id", "quota", name=op.f("pk_tenant_quotas")),
    )


def downgrade() -> None:
    op.drop_table("tenant_quotas")
