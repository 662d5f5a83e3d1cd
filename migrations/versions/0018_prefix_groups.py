"""prefix groups: requests.prefix_group (lines whose prompts start alike share it, set at
validation) and the claim's indexes in (deadline, prefix_group, id) order, so a claim takes a
group's lines together; batches.min_prompt_tokens (set at finalize)

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06 02:40:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

PENDING = sa.text("status = 'pending'")


def upgrade() -> None:
    # A constant default: PostgreSQL adds the column without rewriting the table.
    op.add_column(
        "requests",
        sa.Column("prefix_group", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
    )
    op.add_column("batches", sa.Column("min_prompt_tokens", sa.BigInteger(), nullable=True))
    op.drop_index("ix_requests_claim", table_name="requests")
    op.create_index(
        "ix_requests_claim", "requests", ["model", "status", "deadline", "prefix_group", "id"]
    )
    op.drop_index("ix_requests_pending", table_name="requests")
    op.create_index(
        "ix_requests_pending",
        "requests",
        ["batch_id", "deadline", "prefix_group", "id"],
        postgresql_where=PENDING,
        sqlite_where=PENDING,
    )


def downgrade() -> None:
    op.drop_index("ix_requests_pending", table_name="requests")
    op.create_index(
        "ix_requests_pending",
        "requests",
        ["batch_id", "deadline", "id"],
        postgresql_where=PENDING,
        sqlite_where=PENDING,
    )
    op.drop_index("ix_requests_claim", table_name="requests")
    op.create_index("ix_requests_claim", "requests", ["model", "status", "deadline", "id"])
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("prefix_group")
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("min_prompt_tokens")
