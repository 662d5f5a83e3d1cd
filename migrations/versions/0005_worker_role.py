"""workers: the role of each registered worker (control or engine), for ``/healthz``

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 10:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Workers registered before this revision were all engine workers: only they registered.
    op.add_column(
        "workers",
        sa.Column("role", sa.String(length=32), nullable=False, server_default="engine"),
    )


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("role")
