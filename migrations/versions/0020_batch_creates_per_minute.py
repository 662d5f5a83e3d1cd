"""tenants.batch_creates_per_minute: a tenant's override of the batch creates per minute
default (NULL: the setting's; -1: no limit)

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06 06:40:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch_op:
        batch_op.add_column(sa.Column("batch_creates_per_minute", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch_op:
        batch_op.drop_column("batch_creates_per_minute")
