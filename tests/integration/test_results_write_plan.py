"""The results' write finds its rows by key.

``requests.write_results`` ends a chunk of lines in one ``UPDATE … FROM unnest(arrays)`` under
the write-back's ``RESULTS_PLANNER_SETTINGS``. Its statement is captured as it runs and replayed
under ``EXPLAIN ANALYZE`` (rolled back) on a batch of 100,000 lines late in its drain: the plan
must find the chunk's rows by the primary key. Found any other way, by their status, a write
reads the batch's every line that ran (the status indexes keep an entry for each version of a
row until vacuum comes by) or the whole table, so the drain of a batch took time growing with
the square of its lines (``offpeak bench large-file``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from offpeak.statuses import BatchStatus, LineStatus
from storage.db import get_engine, session_scope
from storage.repositories import requests as requests_repo
from storage.repositories.requests import RESULTS_PLANNER_SETTINGS, FinishedLine, TokenCounts
from tests.support.database import fresh_database

LINES = 100_000
RUNNING = 1_000
CHUNK = 500
#: A request line of about a kilobyte: a table of a batch's size on disk, not of empty rows
#: (a few hundred pages, which a sequential scan reads as cheaply as the chunk's by key).
LINE_JSON = '{"pad": "' + "x" * 1000 + '"}'


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with fresh_database(f"offpeak_writeplan_{int(time.time())}") as url:
        now = int(time.time())
        with session_scope(url) as session:
            # Rows only: the tenant and file the batch would name do not matter here.
            session.execute(text("SET session_replication_role = replica"))
            session.execute(
                text(
                    "INSERT INTO batches (id, tenant_id, endpoint, input_file_id, "
                    "completion_window, window_seconds, status, created_at, expires_at, total, "
                    "completed, failed, input_tokens, cached_tokens, output_tokens) VALUES "
                    "('batch_run', 'plan', '/v1/chat/completions', 'file-plan', '24h', 86400, "
                    ":status, 0, 0, "
                    ":total, 0, 0, 0, 0, 0)"
                ),
                {"status": BatchStatus.IN_PROGRESS, "total": LINES},
            )
            # The batch late in its drain, as the drain leaves it before vacuum comes by: every
            # line went through running (each version of a row has its entries in the indexes
            # on status), most have ended since, the last ones still run on w1.
            session.execute(text("ALTER TABLE requests SET (autovacuum_enabled = false)"))
            session.execute(
                text(
                    "INSERT INTO requests (batch_id, line, custom_id, model, deadline, line_json, "
                    "status, lease_owner, lease_expires_at, attempts, prompt_tokens, "
                    "cached_tokens, completion_tokens) SELECT 'batch_run', n, 'r' || n, 'm', "
                    ":deadline, :line_json, 'running', 'w1', :lease, 1, 0, 0, 0 "
                    "FROM generate_series(0, :lines - 1) AS n"
                ),
                {
                    "deadline": now + 86_400,
                    "line_json": LINE_JSON,
                    "lease": now + 120,
                    "lines": LINES,
                },
            )
            session.execute(
                text(
                    "UPDATE requests SET status = 'succeeded', lease_owner = NULL, "
                    "lease_expires_at = NULL WHERE line < :ended"
                ),
                {"ended": LINES - RUNNING},
            )
            session.execute(text("ANALYZE requests"))
            session.execute(text("ANALYZE batches"))
        yield url


def _captured_write(url: str) -> list[tuple[str, Any]]:
    """``write_results``' statements for a chunk of the running lines, as they ran (at
    psycopg's cursor: the write runs there, in a pipeline), then rolled back."""
    statements: list[tuple[str, Any]] = []
    execute = psycopg.Cursor.execute

    def capture(cursor: Any, query: Any, params: Any = None, **options: Any) -> Any:
        statement = query if isinstance(query, str) else str(query)
        if "written AS" in statement:
            statements.append((statement, params))
        return execute(cursor, query, params, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(psycopg.Cursor, "execute", capture)
        with session_scope(url) as session:
            ids = list(
                session.scalars(
                    text("SELECT id FROM requests WHERE status = 'running' ORDER BY id LIMIT :n"),
                    {"n": CHUNK},
                )
            )
            now = time.time()
            written = requests_repo.write_results(
                session,
                "w1",
                [
                    FinishedLine(
                        i, "batch_run", LineStatus.SUCCEEDED, now, 200, "{}", TokenCounts(1, 0, 1)
                    )
                    for i in ids
                ],
            )
            assert len(written) == CHUNK
            session.rollback()
    return statements


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


def test_a_results_write_reads_only_its_chunk(url: str) -> None:
    statements = _captured_write(url)
    assert statements, "write_results ran no results UPDATE"
    raw = get_engine(url).raw_connection()
    try:
        cursor = raw.cursor()  # in a transaction: rolled back below
        cursor.execute(RESULTS_PLANNER_SETTINGS)
        for statement, params in statements:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, params)
            (plan,) = cursor.fetchone()
            plan = plan if isinstance(plan, list) else json.loads(plan)
            # The scans that find the rows (the update's own node is not one).
            scans = {
                (n["Node Type"], n.get("Index Name"))
                for n in _plan_nodes(plan[0]["Plan"])
                if n["Node Type"] != "ModifyTable"
                and (
                    n.get("Relation Name") == "requests"
                    or (n.get("Index Name") or "").startswith(("ix_requests", "pk_requests"))
                )
            }
            assert scans == {("Index Scan", "pk_requests")}, (
                f"the write finds its rows otherwise than by key: {scans}"
            )
        raw.rollback()
    finally:
        raw.close()
