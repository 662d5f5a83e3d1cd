"""The read path of status polls (``storage.db.read``): a connection in autocommit without
pre-ping, so a connection the database dropped is found dead on use, and the read runs again on
a new one."""

from __future__ import annotations

import io
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from openai import OpenAI
from sqlalchemy import Connection, text
from sqlalchemy.exc import DataError, DBAPIError

from offpeak.settings import Settings
from storage.db import Executor, get_read_engine, read, session_scope
from storage.models import LedgerEntry
from storage.repositories import batches as batches_repo
from storage.repositories import files as files_repo
from tests.integration.test_api import LINE
from tests.support.database import PG_ADMIN


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


def _billed_batch(sdk: OpenAI, settings: Settings) -> tuple[str, str]:
    """A batch with its bill in the ledger; ``(tenant id, batch id)``."""
    file = sdk.files.create(file=("in.jsonl", io.BytesIO(LINE)), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with session_scope(settings.resolved_database_url) as session:
        row = batches_repo.get_any(session, batch.id)
        assert row is not None
        session.add(
            LedgerEntry(
                key=f"batch:{batch.id}", tenant_id=row.tenant_id, batch_id=batch.id, model="m",
                status="completed", created_at=row.created_at, ended_at=row.created_at + 5,
                window_seconds=86_400, billed_at=row.created_at + 5.25, requests=3,
                input_tokens=10, cached_tokens=2, output_tokens=7, gpu_seconds=1.5,
                cost=Decimal("0.000123"), price=Decimal("0.5"), realtime_price=Decimal("1"),
            )
        )  # fmt: skip
        return row.tenant_id, batch.id


def test_the_poll_statements_run_on_the_driver_as_through_sqlalchemy(
    sdk: OpenAI, settings: Settings
) -> None:
    """On PostgreSQL the poll statements run on psycopg's cursor (``storage.db.PollQuery``):
    the same keys, values and value types as the same statement through SQLAlchemy (a
    session), for a billed batch (float and Decimal bill columns), a page and a file."""
    url = settings.resolved_database_url
    tenant_id, batch_id = _billed_batch(sdk, settings)
    assert batches_repo._POLL_ONE._driver_sql(get_read_engine(url).dialect) is not None

    def page(db: Executor) -> list[dict[str, object]]:
        return batches_repo.poll_page(db, tenant_id, after=None, limit=5, exclude_endpoint="x")

    def file_row(db: Executor) -> dict[str, object] | None:
        with session_scope(url) as session:
            stored = batches_repo.get_any(session, batch_id)
            assert stored is not None
            file_id = stored.input_file_id
        return files_repo.poll_row(db, tenant_id, file_id)

    for fn in (lambda db: batches_repo.poll_row(db, tenant_id, batch_id), page, file_row):
        on_driver = read(url, fn)
        with session_scope(url) as session:
            through = fn(session)
        assert on_driver and on_driver == through
        rows = on_driver if isinstance(on_driver, list) else [on_driver]
        throughs = through if isinstance(through, list) else [through]
        for mine, theirs in zip(rows, throughs, strict=True):
            assert list(mine) == list(theirs)
            assert [type(v) for v in mine.values()] == [type(v) for v in theirs.values()]
    billed = read(url, batches_repo.poll_row, tenant_id, batch_id)
    assert billed is not None
    assert billed["bill_cost"] == Decimal("0.000123") and billed["bill_gpu_seconds"] == 1.5


def test_a_poll_statement_on_a_dropped_connection_runs_again(
    sdk: OpenAI, settings: Settings
) -> None:
    """The driver's error on a dropped connection is SQLAlchemy's (``connection_invalidated``),
    so ``read`` runs the poll again on a new connection."""
    url = settings.resolved_database_url
    tenant_id, batch_id = _billed_batch(sdk, settings)
    assert read(url, batches_repo.poll_row, tenant_id, batch_id) is not None
    assert _cut_connections(url) >= 1
    calls: list[int] = []

    def counted(connection: Connection) -> dict[str, object] | None:
        calls.append(1)
        return batches_repo.poll_row(connection, tenant_id, batch_id)

    row = read(url, counted)
    assert row is not None and row["id"] == batch_id
    assert len(calls) == 2, "the first try met the dropped connection and was run again"


def test_a_nul_in_a_poll_statement_is_sqlalchemys_data_error(
    sdk: OpenAI, settings: Settings
) -> None:
    """What the API answers with a 400 (``api.errors``' ``DataError`` handler)."""
    url = settings.resolved_database_url
    tenant_id, _ = _billed_batch(sdk, settings)
    with pytest.raises(DataError):
        read(url, batches_repo.poll_row, tenant_id, "batch_\x00")


def test_poll_reads_run_on_the_event_loop_and_a_file_s_bytes_on_a_thread(
    sdk: OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL a poll's statements run on the event loop (``api.deps.Reader``: handing
    them to a thread cost more than their round trip); content, which also reads the blob
    store, runs on the reader's threads, so a slow store never holds the loop."""
    import asyncio

    from api import deps

    on_loop: dict[str, list[bool]] = {}
    plain_read = deps.read

    def recorded(url: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
            running = True
        except RuntimeError:
            running = False
        on_loop.setdefault(fn.__name__, []).append(running)
        return plain_read(url, fn, *args, **kwargs)

    monkeypatch.setattr(deps, "read", recorded)
    file = sdk.files.create(file=("in.jsonl", io.BytesIO(LINE)), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    sdk.batches.retrieve(batch.id)
    sdk.batches.list(limit=5)
    sdk.files.retrieve(file.id)
    assert sdk.files.content(file.id).content == LINE
    assert on_loop["poll"] == [True] and on_loop["page"] == [True]
    assert on_loop["retrieve"] == [True] and on_loop["content"] == [False]
