"""The read path of status polls (``storage.db.read``): a connection in autocommit without
pre-ping, so a connection the database dropped is found dead on use, and the read runs again on
a new one."""

from __future__ import annotations

import io

import psycopg
from openai import OpenAI
from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

from offpeak.settings import Settings
from storage.db import read, session_scope
from storage.repositories import batches as batches_repo
from tests.conftest import PG_ADMIN
from tests.test_api import LINE


def _backend_pid(connection: Connection) -> int:
    return int(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _cut_connections(database_url: str) -> int:
    """Terminate every server process on the test database (as a database restart would)."""
    name = database_url.rsplit("/", 1)[1]
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        ).fetchall()
    return len(rows)


def test_a_read_on_a_dropped_connection_runs_again(database_url: str) -> None:
    before = read(database_url, _backend_pid)
    assert _cut_connections(database_url) >= 1
    calls: list[int] = []

    def counted(connection: Connection) -> int:
        calls.append(1)
        return _backend_pid(connection)

    after = read(database_url, counted)
    assert after != before
    assert len(calls) == 2, "the first try met the dropped connection and was run again"


def test_reads_are_autocommit(database_url: str) -> None:
    """No transaction is open while a read runs (no BEGIN/COMMIT round trips)."""

    def in_transaction(connection: Connection) -> bool:
        connection.execute(text("SELECT 1"))
        dbapi = connection.connection.dbapi_connection
        assert isinstance(dbapi, psycopg.Connection)
        # After a statement in a transaction the server reports INTRANS; in autocommit, IDLE.
        return dbapi.info.transaction_status != psycopg.pq.TransactionStatus.IDLE

    assert read(database_url, in_transaction) is False


def test_an_error_that_is_not_a_disconnect_is_raised_once(database_url: str) -> None:
    calls: list[int] = []

    def bad(connection: Connection) -> None:
        calls.append(1)
        connection.execute(text("SELECT no_such_column FROM batches"))

    try:
        read(database_url, bad)
    except DBAPIError as exc:
        assert not exc.connection_invalidated
    else:
        raise AssertionError("the bad statement did not raise")
    assert len(calls) == 1


def test_a_poll_sees_a_status_change_at_once(sdk: OpenAI, settings: Settings) -> None:
    """Nothing caches a batch between polls: a status a worker commits is in the next retrieve
    and list (several API processes and the workers write; no cache of one process could know)."""
    file = sdk.files.create(file=("in.jsonl", io.BytesIO(LINE)), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert sdk.batches.retrieve(batch.id).status == "validating"
    with session_scope(settings.resolved_database_url) as session:  # as a worker would
        row = batches_repo.get_any(session, batch.id)
        assert row is not None
        row.status, row.total, row.completed = "in_progress", 3, 1
    polled = sdk.batches.retrieve(batch.id)
    assert polled.status == "in_progress" and polled.request_counts is not None
    assert (polled.request_counts.total, polled.request_counts.completed) == (3, 1)
    (listed,) = [b for b in sdk.batches.list(limit=5).data if b.id == batch.id]
    assert listed.status == "in_progress"
