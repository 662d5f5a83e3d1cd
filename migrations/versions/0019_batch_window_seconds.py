"""batch window seconds: batches.window_seconds, the completion window's length parsed once at
create (the deadline guard and billing read it instead of parsing completion_window again);
existing rows get expires_at - created_at, which the create set from the same window

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06 06:30:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.add_column(sa.Column("window_seconds", sa.Integer(), nullable=True))
    op.execute("UPDATE batches SET window_seconds = expires_at - created_at")
    with op.batch_alter_table("batches") as batch_op:
        batch_op.alter_column("window_seconds", existing_type=sa.Integer(), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.drop_column("window_seconds")
