"""Archives in the artifact store (issue 19).

A sandbox's row names the bundle that holds it as it is now (``archive``: a hibernated
sandbox uploaded by its node), a snapshot's row says whether the store holds it
(``archived``), and ``stale_archives`` lists bundles no row names any more, for the
background job to delete from the store.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision: str | None = "0007"
branch_labels: tuple[str, ...] | None = None
depends_on: tuple[str, ...] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sandboxes") as batch:
        batch.add_column(sa.Column("archive", sa.String(160), nullable=True))
    with op.batch_alter_table("snapshots") as batch:
        batch.add_column(
            sa.Column("archived", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    op.create_table(
        "stale_archives",
        sa.Column("name", sa.String(160), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_stale_archives")),
    )


def downgrade() -> None:
    op.drop_table("stale_archives")
    with op.batch_alter_table("snapshots") as batch:
        batch.drop_column("archived")
    with op.batch_alter_table("sandboxes") as batch:
        batch.drop_column("archive")
