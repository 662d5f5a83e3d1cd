"""results order: requests.finished_seq, the order in which a batch's lines become readable
while it runs (GET /v1/batches/{id}/results), drawn from batches.results_seq, with the indexes
that page through it and find a page's cursor (an output line's id) in a stored result

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 02:50:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

#: As ``storage.models.STORED_LINE_ID``: the ``line_id`` of a stored record, which
#: its first 400 characters hold.
STORED_LINE_ID = """"substring"("left"(result, 400), '"line_id":"([^"]+)"'::text)"""


def upgrade() -> None:
    op.add_column(
        "batches",
        sa.Column("results_seq", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.add_column("requests", sa.Column("finished_seq", sa.BigInteger(), nullable=True))
    op.create_index(
        "ix_requests_finished",
        "requests",
        ["batch_id", "finished_seq", "id"],
        postgresql_where=sa.text("finished_seq IS NOT NULL"),
        sqlite_where=sa.text("finished_seq IS NOT NULL"),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.create_index(
            "ix_requests_line_id",
            "requests",
            ["batch_id", sa.text(STORED_LINE_ID)],
            postgresql_where=sa.text("finished_seq IS NOT NULL"),
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_requests_line_id", table_name="requests")
    op.drop_index("ix_requests_finished", table_name="requests")
    op.drop_column("requests", "finished_seq")
    op.drop_column("batches", "results_seq")
