"""The claim walks its index.

``requests.claim`` and the fair share's ``shared_claims.claim_shared`` are the hottest queries of
an engine worker. Their statements are captured as they run and replayed under ``EXPLAIN`` (after
the claim's own planner settings) on a table of 30,000 pending rows: each must be an index scan
with no sort (a sort means every pending row of the batch or model was read and ordered to return
a few hundred), and a batch's share must come from ``ix_requests_pending`` (any other index of the
batch walks past every line claimed before). Twice: with the
table analyzed after the rows went in, and with statistics from before them (``stale``: a large
batch just copied in, autovacuum not yet come by), where PostgreSQL read a batch's every pending
row by another index and sorted them on each claim (seen in ``offpeak bench control``).
The claim's answers are checked too: lapsed leases first, then pending rows in deadline order,
rows of batches that are not running left alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import text, update

from offpeak.statuses import BatchStatus, LineStatus
from storage.db import get_engine, session_scope
from storage.models import RequestLine
from storage.repositories import requests as requests_repo
from storage.repositories import shared_claims
from storage.repositories.shared_claims import Shares
from tests.support.database import fresh_database, request_row

PENDING = 30_000


def _batch(session: Any, batch_id: str, status: str) -> None:
    session.execute(
        text(
            "INSERT INTO batches (id, tenant_id, endpoint, input_file_id, completion_window, "
            "window_seconds, status, created_at, expires_at, total, completed, failed, "
            "input_tokens, cached_tokens, output_tokens) VALUES (:id, 'plan', "
            "'/v1/chat/completions', 'file-plan', '24h', 86400, :status, 0, 0, 0, 0, 0, 0, 0, 0)"
        ),
        {"id": batch_id, "status": status},
    )


@pytest.fixture(scope="module", params=["analyzed", "stale"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    stale = request.param == "stale"
    with fresh_database(f"offpeak_claimplan_{request.param}_{int(time.time())}") as url:
        now = int(time.time())
        with session_scope(url) as session:
            # Rows only: the tenants and files these batches would name do not matter here.
            session.execute(text("SET session_replication_role = replica"))
            if stale:
                # Statistics taken while the table held one small finished batch, and kept so.
                session.execute(text("ALTER TABLE requests SET (autovacuum_enabled = false)"))
                _batch(session, "batch_old", BatchStatus.COMPLETED)
                session.execute(
                    RequestLine.__table__.insert(),
                    [
                        request_row("batch_old", i, now - 86_400) | {"status": LineStatus.SUCCEEDED}
                        for i in range(200)
                    ],
                )
                session.execute(text("ANALYZE requests"))
                session.execute(text("ANALYZE batches"))
            _batch(session, "batch_run", BatchStatus.IN_PROGRESS)
            _batch(session, "batch_gone", BatchStatus.CANCELLING)
            # Later lines are due sooner: deadline order is not id order.
            rows = [request_row("batch_run", i, now + 86_400 - i // 1000) for i in range(PENDING)]
            rows += [
                r | {"batch_id": "batch_gone", "line": r["line"], "deadline": now + 10}
                for r in rows[:100]
            ]
            session.execute(RequestLine.__table__.insert(), rows)
            if not stale:
                session.execute(text("ANALYZE requests"))
                session.execute(text("ANALYZE batches"))
        yield url


def _captured_claim(url: str, **kwargs: Any) -> tuple[list[Any], list[tuple[str, Any]]]:
    """``requests.claim``'s answer and its statements as they ran (``_captured``)."""
    return _captured(url, lambda session, now: requests_repo.claim(
        session, model="m", owner="w1", lease_until=now + 120, at=now, **kwargs
    ))  # fmt: skip


def _captured(url: str, claim: Any) -> tuple[Any, list[tuple[str, Any]]]:
    """``claim(session, now)``'s answer and its statements as they ran: the locking statements,
    and the planner settings the claim makes for them. Captured at psycopg's cursor (the claim
    runs there, in a pipeline, not through SQLAlchemy's execution events)."""
    statements: list[tuple[str, Any]] = []
    execute = psycopg.Cursor.execute

    def capture(cursor: Any, query: Any, params: Any = None, **options: Any) -> Any:
        statement = query if isinstance(query, str) else str(query)
        if "FOR UPDATE" in statement or statement.startswith(SETTINGS):
            statements.append((statement, params))
        return execute(cursor, query, params, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(psycopg.Cursor, "execute", capture)
        with session_scope(url) as session:
            claimed = claim(session, time.time())
            session.rollback()  # leave the rows pending for the next test
    return claimed, statements


#: How the claims' planner settings start (``requests.NO_SORTS``,
#: ``shared_claims.PLANNER_SETTINGS``).
SETTINGS = ("SET LOCAL", "SELECT set_config")


def _explained(url: str, statements: list[tuple[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Each locking statement's plan nodes, under the planner settings captured before it."""
    raw = get_engine(url).raw_connection()
    try:
        cursor = raw.cursor()  # in a transaction: the claim's settings hold until it ends
        for statement, params in statements:
            if statement.startswith(SETTINGS):
                cursor.execute(statement, params)
                continue
            cursor.execute("EXPLAIN (FORMAT JSON) " + statement, params)
            (plan,) = cursor.fetchone()
            plan = plan if isinstance(plan, list) else json.loads(plan)
            nodes = list(_plan_nodes(plan[0]["Plan"]))
            kinds = [(n["Node Type"], n.get("Index Name")) for n in nodes]
            assert "Sort" not in {k for k, _ in kinds}, f"the claim sorts: {kinds}\n{statement}"
            assert all(
                n.get("Relation Name") != "requests" for n in nodes if n["Node Type"] == "Seq Scan"
            ), f"the claim reads the requests table whole: {kinds}"
            yield nodes
    finally:
        raw.close()


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


def test_each_claim_statement_is_an_ordered_index_scan(url: str) -> None:
    claimed, statements = _captured_claim(url, limit=320)
    assert len(claimed) == 320
    assert statements, "the claim ran no locking SELECT"
    for nodes in _explained(url, statements):
        assert any(n.get("Index Name") == "ix_requests_claim" for n in nodes), nodes


def test_a_batch_share_is_read_from_its_pending_lines(url: str) -> None:
    """The fair share's claim takes a batch's share in claim order from ``ix_requests_pending``
    (or the model's claim index, with a batch the whole table): with statistics from while
    every line was pending (``analyzed``), the planner read the batch by (batch, line) or the
    primary key instead, past every line claimed before, on every claim."""
    shares = Shares(quotas=(("batch_run", 300),), known=("batch_run",))
    claimed, statements = _captured(url, lambda session, now: shared_claims.claim_shared(
        session, model="m", limit=300, owner="w1", lease_until=now + 120, at=now, shares=shares
    ))  # fmt: skip
    with session_scope(url) as session:
        first = list(
            session.scalars(
                text(
                    "SELECT id FROM requests WHERE batch_id = 'batch_run' "
                    "ORDER BY deadline, id LIMIT 300"
                )
            )
        )
    assert [r.id for r in claimed.rows] == sorted(first)  # the batch's share, in claim order
    for nodes in _explained(url, statements):
        locked = {
            child.get("Index Name")
            for n in nodes
            if n["Node Type"] == "LockRows"
            for child in n.get("Plans", [])
        }
        assert locked <= ON_STATUS, f"a locking scan reads past claimed lines: {locked}"
        assert "ix_requests_pending" in locked, locked


def test_a_claim_of_named_batches_alone_reads_only_their_pending_lines(url: str) -> None:
    """Without ``fill`` (a full queue's look for new batches) a claim takes each named batch's
    quota from its pending lines and nothing more: no walk of the model's claim index, which
    passes every pending line of every batch due sooner (a large one held elsewhere)."""
    shares = Shares(quotas=(("batch_run", 10),), known=("batch_run",), fill=False)
    claimed, statements = _captured(url, lambda session, now: shared_claims.claim_shared(
        session, model="m", limit=300, owner="w1", lease_until=now + 120, at=now, shares=shares
    ))  # fmt: skip
    assert len(claimed.rows) == 10 and {r.batch_id for r in claimed.rows} == {"batch_run"}
    for nodes in _explained(url, statements):
        indexes = {n.get("Index Name") for n in nodes} - {None}
        assert "ix_requests_claim" not in indexes, indexes
        assert "ix_requests_pending" in indexes, indexes


#: The indexes that hold only pending lines in claim order, or key them by status first: a
#: claim's scan of them never passes a line claimed before.
ON_STATUS = {"ix_requests_pending", "ix_requests_claim"}


def test_claims_earliest_deadline_first_and_only_running_batches(url: str) -> None:
    claimed, _ = _captured_claim(url, limit=1500)
    with session_scope(url) as session:
        deadlines = dict(
            session.execute(
                text("SELECT id, deadline FROM requests WHERE id = ANY(:ids)"),
                {"ids": [c.id for c in claimed]},
            ).all()
        )
    assert {c.batch_id for c in claimed} == {"batch_run"}  # the cancelling batch's rows wait
    picked = [deadlines[c.id] for c in claimed]
    latest_picked = max(picked)
    with session_scope(url) as session:
        earlier_left = session.scalar(
            text(
                "SELECT count(*) FROM requests WHERE batch_id = 'batch_run' AND deadline < :d "
                "AND NOT (id = ANY(:ids))"
            ),
            {"d": latest_picked, "ids": [c.id for c in claimed]},
        )
    assert earlier_left == 0, "a row due sooner was left for one due later"


def test_lapsed_leases_come_back_first(url: str) -> None:
    with session_scope(url) as session:
        lapsed = [
            row_id
            for (row_id,) in session.execute(
                text("SELECT id FROM requests WHERE batch_id = 'batch_run' ORDER BY id LIMIT 3")
            )
        ]
        held = session.scalar(
            text(
                "SELECT id FROM requests WHERE batch_id = 'batch_run' ORDER BY id OFFSET 3 LIMIT 1"
            )
        )
        session.execute(
            update(RequestLine)
            .where(RequestLine.id.in_(lapsed))
            .values(status=LineStatus.RUNNING, lease_owner="dead", lease_expires_at=time.time() - 1)
        )
        session.execute(
            update(RequestLine)
            .where(RequestLine.id == held)
            .values(
                status=LineStatus.RUNNING, lease_owner="alive", lease_expires_at=time.time() + 600
            )
        )
    try:
        claimed, _ = _captured_claim(url, limit=10)
        ids = [c.id for c in claimed]
        assert set(lapsed) <= set(ids), "a row whose worker died was not taken over"
        assert held not in ids, "a row another worker still holds was taken"
        urgent_only, _ = _captured_claim(url, limit=10, batch_ids={"batch_gone"})
        assert urgent_only == []  # not running: nothing to claim, whatever the filter says
    finally:
        with session_scope(url) as session:
            session.execute(
                update(RequestLine)
                .where(RequestLine.id.in_([*lapsed, held]))
                .values(status=LineStatus.PENDING, lease_owner=None, lease_expires_at=None)
            )
