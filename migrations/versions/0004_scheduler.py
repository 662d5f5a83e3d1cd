"""scheduler: the estimated completion time of each batch

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 12:20:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("estimated_completion_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("estimated_completion_at")
