"""failure limit: batches.failure_limit, a batch's breaker ({"fraction", "after_lines"}), and
batches.failure_limit_reached_at, when it tripped (the batch then ends failed)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 03:10:00.000000
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    json_type = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
    op.add_column("batches", sa.Column("failure_limit", json_type, nullable=True))
    op.add_column("batches", sa.Column("failure_limit_reached_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("batches", "failure_limit_reached_at")
    op.drop_column("batches", "failure_limit")
