"""batch pause: batches.paused_at, set while a batch is paused (POST /v1/batches/{id}/pause):
the claims skip its lines

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 03:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("paused_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("batches", "paused_at")
