"""A process's connections to PostgreSQL (``Settings.database_pool``, ``OFFPEAK_DATABASE_POOL__*``):
the sizes of its two pools (``storage.db``) and whether its statements may be prepared on the
server. docs/deployment.md adds them up for a fleet."""

from __future__ import annotations

from pydantic import BaseModel, Field


class DatabasePool(BaseModel):
    size: int = Field(
        default=10,
        ge=1,
        description="Connections the pool of sessions (tasks, the API's writes) keeps open.",
    )
    overflow: int = Field(
        default=20,
        ge=0,
        description="More it may open under a burst, each closed again when returned.",
    )
    read_size: int = Field(
        default=20,
        ge=1,
        description=(
            "Connections of the pool of reads (``storage.db.read``: the API's status "
            "polls); no overflow."
        ),
    )
    prepared_statements: bool = Field(
        default=True,
        description=(
            "psycopg prepares a statement on its connection once run 5 times there. Off "
            "behind a pooler in transaction mode that does not track prepared statements "
            "(PgBouncer before 1.21, or without ``max_prepared_statements``): the next "
            "transaction may get another server connection, where the statement does not "
            "exist."
        ),
    )
