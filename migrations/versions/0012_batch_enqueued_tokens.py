"""batch enqueued tokens: batches.enqueued_tokens, the prompt + requested output tokens of a
batch's lines counted at validation, against which the enqueued-token quota is checked

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04 17:30:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.add_column(sa.Column("enqueued_tokens", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.drop_column("enqueued_tokens")
