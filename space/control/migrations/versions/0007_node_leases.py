"""Node leases and the replicas' job leases (issue 19).

A node's row gains its state (``active``, ``draining`` or ``lost``), the end of its
lease (renewed by each heartbeat) and the capacity it last reported; ``job_leases``
holds, per background job, which control-plane replica runs it and until when.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision: str | None = "0006"
branch_labels: tuple[str, ...] | None = None
depends_on: tuple[str, ...] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("state", sa.String(16), nullable=False, server_default="active"))
        batch.add_column(sa.Column("lease_expires_at", sa.Float(), nullable=True))
        batch.add_column(sa.Column("capacity", sa.JSON(), nullable=True))
    op.create_table(
        "job_leases",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("holder", sa.String(64), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_job_leases")),
    )


def downgrade() -> None:
    op.drop_table("job_leases")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("capacity")
        batch.drop_column("lease_expires_at")
        batch.drop_column("state")
