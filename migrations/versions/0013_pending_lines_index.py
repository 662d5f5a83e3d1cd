"""pending lines index: ix_requests_pending, a batch's pending lines in claim order (deadline,
id; partial, on status = 'pending'), which the fair share's per-batch probe reads

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04 23:45:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_requests_pending",
        "requests",
        ["batch_id", "deadline", "id"],
        postgresql_where=sa.text("status = 'pending'"),
        sqlite_where=sa.text("status = 'pending'"),
    )


def downgrade() -> None:
    op.drop_index("ix_requests_pending", table_name="requests")
