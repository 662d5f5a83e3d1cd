"""message batches (Anthropic's surface): batches.deleted_at, set when a Message Batch is
deleted, and batches.requests_submitted, its number of requests as created

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 13:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.add_column(sa.Column("deleted_at", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("requests_submitted", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.drop_column("requests_submitted")
        batch_op.drop_column("deleted_at")
