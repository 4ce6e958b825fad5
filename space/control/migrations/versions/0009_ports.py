"""Port exposure (issue 20): who may reach servers listening in a sandbox.

``sandboxes.ports`` is "off" (the default: nobody), "token" (requests carrying the
sandbox's traffic token) or "public" (anyone who knows its address).

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision: str | None = "0008"
branch_labels: tuple[str, ...] | None = None
depends_on: tuple[str, ...] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("ports", sa.String(16), nullable=False, server_default="off"))


def downgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("ports")
