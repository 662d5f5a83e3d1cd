"""tenant weights and limits: tenants.weight for fair sharing, and per-tenant overrides of the
quota and rate-limit defaults (NULL: the setting's default)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04 17:10:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch_op:
        batch_op.add_column(sa.Column("weight", sa.Float(), nullable=False, server_default="1"))
        batch_op.add_column(sa.Column("max_enqueued_tokens", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("max_batches_in_progress", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("max_file_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("requests_per_minute", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch_op:
        for column in (
            "requests_per_minute",
            "max_file_bytes",
            "max_batches_in_progress",
            "max_enqueued_tokens",
            "weight",
        ):
            batch_op.drop_column(column)
