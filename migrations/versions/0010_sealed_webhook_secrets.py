"""sealed webhook secrets: webhook_endpoints.secret and previous_secret wide enough for a
Fernet token (``storage.sealing``)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 15:30:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("webhook_endpoints") as batch_op:
        for column in ("secret", "previous_secret"):
            batch_op.alter_column(column, type_=sa.String(255), existing_type=sa.String(100))


def downgrade() -> None:
    with op.batch_alter_table("webhook_endpoints") as batch_op:
        for column in ("secret", "previous_secret"):
            batch_op.alter_column(column, type_=sa.String(100), existing_type=sa.String(255))
