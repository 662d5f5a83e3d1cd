"""queued messages: one record per queued task message (finalize, drain, validate), and one
live file per blob

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 12:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# Output and error files written twice by racing finalizes: a second, unreferenced row
# on the same blob. It is marked deleted, not removed, and its blob (the referenced file's too)
# is kept; the unique index below then holds.
_DROP_UNREFERENCED_TWINS = """
UPDATE files SET deleted = true
WHERE purpose = 'batch_output' AND NOT deleted
  AND id NOT IN (
    SELECT output_file_id FROM batches WHERE output_file_id IS NOT NULL
    UNION SELECT error_file_id FROM batches WHERE error_file_id IS NOT NULL)
  AND EXISTS (
    SELECT 1 FROM files AS twin
    WHERE twin.blob_key = files.blob_key AND twin.id <> files.id AND NOT twin.deleted)
"""


def upgrade() -> None:
    op.create_table(
        "queued_messages",
        sa.Column("key", sa.String(length=300), nullable=False),
        sa.Column("mark", sa.String(length=32), nullable=False),
        sa.Column("sent_at", sa.Float(), nullable=False),
        sa.Column("due_at", sa.Float(), nullable=False),
        sa.Column("wait_seconds", sa.Float(), nullable=False),
        sa.Column("resend_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_queued_messages")),
    )
    op.execute(_DROP_UNREFERENCED_TWINS)
    op.create_index(
        "uq_files_blob_key_live",
        "files",
        ["blob_key"],
        unique=True,
        postgresql_where=sa.text("NOT deleted"),
        sqlite_where=sa.text("NOT deleted"),
    )


def downgrade() -> None:
    op.drop_index("uq_files_blob_key_live", table_name="files")
    op.drop_table("queued_messages")
