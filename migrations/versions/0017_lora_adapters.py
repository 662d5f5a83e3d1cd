"""lora adapters: lora_adapters (adapters registered at run time), requests.adapter (the adapter
a line names) and ledger_adapter_usage (a batch's bill split by adapter)

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06 03:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

Money = sa.Numeric(20, 10)


def upgrade() -> None:
    op.create_table(
        "lora_adapters",
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("base_model", sa.String(200), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_lora_adapters"),
    )
    op.add_column("requests", sa.Column("adapter", sa.String(200), nullable=True))
    op.create_table(
        "ledger_adapter_usage",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("batch_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(200), nullable=True),
        sa.Column("adapter", sa.String(200), nullable=False),
        sa.Column("ended_at", sa.BigInteger(), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.Column("cost", Money, nullable=False),
        sa.Column("price", Money, nullable=False),
        sa.Column("realtime_price", Money, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_ledger_adapter_usage"),
        sa.UniqueConstraint("key", "adapter", name="uq_ledger_adapter_usage_key_adapter"),
    )
    # Bills written before adapters existed are the base model's lines alone.
    op.execute(
        "INSERT INTO ledger_adapter_usage (key, tenant_id, batch_id, model, adapter, ended_at, "
        "requests, input_tokens, cached_tokens, output_tokens, gpu_seconds, cost, price, "
        "realtime_price) SELECT key, tenant_id, batch_id, model, '', ended_at, requests, "
        "input_tokens, cached_tokens, output_tokens, gpu_seconds, cost, price, realtime_price "
        "FROM ledger_entries"
    )
    op.create_index(
        "ix_ledger_adapter_usage_tenant_ended",
        "ledger_adapter_usage",
        ["tenant_id", "ended_at"],
    )


def downgrade() -> None:
    op.drop_index("ix_ledger_adapter_usage_tenant_ended", table_name="ledger_adapter_usage")
    op.drop_table("ledger_adapter_usage")
    op.drop_column("requests", "adapter")
    op.drop_table("lora_adapters")
