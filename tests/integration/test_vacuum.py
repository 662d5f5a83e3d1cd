"""The sweep's vacuum (``workers.vacuum``) on a PostgreSQL server of the module's own, whose
autovacuum the tests turn off and on (``ALTER SYSTEM``): with it off, a table past the
autovacuum rule (its own parameters, else the server's) is vacuumed and analyzed and the others
are left alone; with it on, or with the ``vacuum`` setting off, nothing is; a database that is
away fails nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

import migrations
from offpeak.settings import Settings
from offpeak.statuses import LineStatus
from storage.db import get_engine, session_scope
from storage.models import RequestLine
from tests.support.database import request_row
from tests.support.servers import PostgresServer, free_port
from workers import vacuum

LINES = 2000


def server_autovacuum(server: PostgresServer, on: bool) -> None:
    """Turn the server's autovacuum on or off (its own server: ``ALTER SYSTEM`` is safe)."""
    with psycopg.connect(server.url(driver="postgresql"), autocommit=True) as conn:
        conn.execute(f"ALTER SYSTEM SET autovacuum = {'on' if on else 'off'}")
        conn.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 10
        while conn.execute("SHOW autovacuum").fetchone() != ("on" if on else "off",):
            assert time.monotonic() < deadline, "the server did not take the setting"
            time.sleep(0.05)


def stats(url: str, table: str) -> dict[str, Any]:
    with get_engine(url).connect() as conn:
        row = conn.execute(
            text(
                "SELECT n_dead_tup, last_vacuum, last_analyze FROM pg_stat_user_tables "
                "WHERE relname = :table"
            ),
            {"table": table},
        ).one()
    return dict(row._mapping)


@pytest.fixture()
def url(own_postgres: PostgresServer) -> Iterator[str]:
    """A migrated database whose ``requests`` holds ``LINES`` rows, each updated twice (a claim
    and a result), so its dead rows are past the autovacuum rule (50 + 0.2 × live rows); the
    server's autovacuum is off (the tests run one at a time on this server)."""
    server_autovacuum(own_postgres, False)
    name = f"vacuum_{time.monotonic_ns()}"
    url = own_postgres.create_database(name)
    migrations.upgrade(url)
    with session_scope(url) as session:
        session.execute(text("SET session_replication_role = replica"))  # no tenant, no file
        session.execute(
            RequestLine.__table__.insert(),
            [request_row("batch_v", i, 0) for i in range(LINES)],
        )
    for status in (LineStatus.RUNNING, LineStatus.SUCCEEDED):
        with session_scope(url) as session:
            session.execute(text("UPDATE requests SET status = :s"), {"s": status})
    with get_engine(url).connect() as conn:
        # This backend's counts reach the statistics at its next transaction's end.
        conn.execute(text("SELECT pg_stat_force_next_flush()"))
        conn.commit()
    # A backend whose counts were not forced reports them within PostgreSQL's idle interval (10 s).
    deadline = time.monotonic() + 30
    while stats(url, "requests")["n_dead_tup"] < 2 * LINES:
        assert time.monotonic() < deadline, stats(url, "requests")
        time.sleep(0.1)
    try:
        yield url
    finally:
        get_engine.cache_clear()
        with psycopg.connect(own_postgres.url(driver="postgresql"), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def settings_for(url: str, **changes: Any) -> Settings:
    return Settings(database_url=url, **changes)


def test_with_autovacuum_off_a_table_past_the_rule_is_vacuumed_and_analyzed(url: str) -> None:
    assert vacuum.sweep(settings_for(url)) == ["requests"]
    after = stats(url, "requests")
    assert after["n_dead_tup"] == 0 and after["last_vacuum"] and after["last_analyze"]
    # The tables under the rule were left alone; nothing is due in the next sweep.
    assert stats(url, "batches")["last_vacuum"] is None
    assert vacuum.sweep(settings_for(url)) == []


def test_a_tables_own_autovacuum_parameters_come_before_the_servers(url: str) -> None:
    with session_scope(url) as session:
        session.execute(
            text(
                "ALTER TABLE requests SET (autovacuum_vacuum_threshold = 100000, "
                "autovacuum_vacuum_scale_factor = 0.5)"
            )
        )
    assert vacuum.sweep(settings_for(url)) == []
    with session_scope(url) as session:
        session.execute(text("ALTER TABLE requests SET (autovacuum_vacuum_threshold = 10)"))
    assert vacuum.sweep(settings_for(url)) == ["requests"]


def test_nothing_is_vacuumed_with_the_setting_off(url: str) -> None:
    assert vacuum.sweep(settings_for(url, vacuum="off")) == []
    assert stats(url, "requests")["last_vacuum"] is None


def test_nothing_is_vacuumed_where_the_server_runs_autovacuum(
    url: str,
    own_postgres: PostgresServer,
) -> None:
    server_autovacuum(own_postgres, True)
    try:
        assert vacuum.sweep(settings_for(url)) == []
    finally:
        server_autovacuum(own_postgres, False)


def test_a_database_that_is_away_fails_nothing(caplog: pytest.LogCaptureFixture) -> None:
    away = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/gone?connect_timeout=2"
    assert vacuum.sweep(settings_for(away)) == []
    assert "vacuum failed" in caplog.text
