"""The schema comes only from Alembic; the models must match what the migrations build."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

import migrations
from storage.models import Base


def test_models_match_migrations_on_postgres(database_url: str) -> None:
    engine = create_engine(database_url)
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []
    engine.dispose()


def test_migrations_run_on_sqlite(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'offpeak.db'}"
    migrations.upgrade(url)
    migrations.upgrade(url)  # idempotent
    engine = create_engine(url)
    with engine.connect() as connection:
        context = MigrationContext.configure(connection)
        assert context.get_current_revision() is not None
    engine.dispose()
