"""Alembic migrations: the only way the schema comes to exist. See ``upgrade``."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

HERE = Path(__file__).resolve().parent


def alembic_config(database_url: str) -> Config:
    """An Alembic config pointing at this folder and ``database_url``."""
    config = Config()
    config.set_main_option("script_location", str(HERE))
    # ConfigParser interpolation: a literal % in a URL (an escaped password) must be doubled.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Bring the database at ``database_url`` to ``revision`` (idempotent)."""
    command.upgrade(alembic_config(database_url), revision)


def revisions(database_url: str) -> tuple[str | None, str | None]:
    """``(the database's revision, the code's head revision)``; equal when migrated."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from sqlalchemy import create_engine, pool

    from storage.db import connect_args

    head = ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()
    engine = create_engine(
        database_url, poolclass=pool.NullPool, connect_args=connect_args(database_url)
    )
    try:
        with engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
    return current, head
