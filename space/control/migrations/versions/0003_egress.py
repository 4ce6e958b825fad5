"""Egress (issue 5): each sandbox keeps its egress policy, the desired state.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision: str | None = "0002"
branch_labels: tuple[str, ...] | None = None
depends_on: tuple[str, ...] | None = None


def upgrade() -> None:
    # Nullable without a default (a plain ADD COLUMN everywhere): null means no network,
    # which is what every sandbox made before egress existed had.
    op.add_column("sandboxes", sa.Column("egress", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("egress")
