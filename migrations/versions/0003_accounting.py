"""accounting: the billing ledger and the load-signal history

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 12:02:16.360882
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
MONEY = sa.Numeric(precision=20, scale=10)


def upgrade() -> None:
    op.create_table(
        "ledger_entries",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("ended_at", sa.BigInteger(), nullable=False),
        sa.Column("window_seconds", sa.Integer(), nullable=False),
        sa.Column("billed_at", sa.Float(), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.Column("cost", MONEY, nullable=False),
        sa.Column("price", MONEY, nullable=False),
        sa.Column("realtime_price", MONEY, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_entries")),
        sa.UniqueConstraint("key", name=op.f("uq_ledger_entries_key")),
    )
    op.create_index(
        op.f("ix_ledger_entries_batch_id"), "ledger_entries", ["batch_id"], unique=False
    )
    op.create_index(
        "ix_ledger_entries_tenant_ended", "ledger_entries", ["tenant_id", "ended_at"], unique=False
    )
    op.create_table(
        "load_samples",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("source", sa.String(length=200), nullable=False),
        sa.Column("load", sa.Float(), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_load_samples")),
    )
    op.create_index(op.f("ix_load_samples_at"), "load_samples", ["at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_load_samples_at"), table_name="load_samples")
    op.drop_table("load_samples")
    op.drop_index("ix_ledger_entries_tenant_ended", table_name="ledger_entries")
    op.drop_index(op.f("ix_ledger_entries_batch_id"), table_name="ledger_entries")
    op.drop_table("ledger_entries")
