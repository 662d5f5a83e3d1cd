"""Request lines: bulk intake, claims with leases, results, and streaming reads for the files.

Claims use ``SELECT … FOR UPDATE SKIP LOCKED`` on PostgreSQL so several workers take disjoint
chunks without waiting on each other; a claim is a lease (owner, expiry) that a heartbeat renews
and that another worker may take over once it has run out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, insert, or_, select, update
from sqlalchemy.orm import Session

from storage.db import is_postgres
from storage.models import Batch, RequestLine

#: Columns written at intake, in COPY order.
INTAKE_COLUMNS = ("batch_id", "line", "custom_id", "model", "deadline", "line_json")


@dataclass(frozen=True)
class ClaimedRequest:
    id: int
    batch_id: str
    custom_id: str
    line_json: str
    attempts: int


def bulk_insert(session: Session, rows: Sequence[tuple[str, int, str, str, int, str]]) -> None:
    """Insert request rows (tuples in ``INTAKE_COLUMNS`` order) in one round trip: COPY on
    PostgreSQL, one multi-row ``executemany`` elsewhere."""
    if not rows:
        return
    if is_postgres(session):
        raw = session.connection().connection.driver_connection
        columns = ", ".join(INTAKE_COLUMNS)
        extra = "status, prompt_tokens, cached_tokens, completion_tokens, attempts"
        with (
            raw.cursor() as cursor,
            cursor.copy(f"COPY requests ({columns}, {extra}) FROM STDIN") as copy,
        ):
            for row in rows:
                copy.write_row((*row, "pending", 0, 0, 0, 0))
        return
    session.execute(
        insert(RequestLine),
        [
            dict(zip(INTAKE_COLUMNS, row, strict=True))
            | {
                "status": "pending",
                "prompt_tokens": 0,
                "cached_tokens": 0,
                "completion_tokens": 0,
                "attempts": 0,
            }
            for row in rows
        ],
    )


def claim(
    session: Session,
    *,
    model: str,
    limit: int,
    owner: str,
    lease_until: float,
    at: float,
) -> list[ClaimedRequest]:
    """Take up to ``limit`` runnable request rows of ``model``, earliest deadline first: pending
    rows, and running rows whose lease ran out before ``at`` (their worker died). Rows of batches
    not ``in_progress`` are left alone. Skips rows another transaction holds."""
    runnable = or_(
        RequestLine.status == "pending",
        (RequestLine.status == "running") & (RequestLine.lease_expires_at < at),
    )
    picked = (
        select(RequestLine.id)
        .where(
            RequestLine.model == model,
            runnable,
            RequestLine.batch_id.in_(select(Batch.id).where(Batch.status == "in_progress")),
        )
        .order_by(RequestLine.deadline, RequestLine.id)
        .limit(limit)
    )
    picked = picked.with_for_update(skip_locked=True, of=RequestLine)
    ids = list(session.scalars(picked))
    if not ids:
        return []
    rows = session.execute(
        update(RequestLine)
        .where(RequestLine.id.in_(ids))
        .values(
            status="running",
            lease_owner=owner,
            lease_expires_at=lease_until,
            attempts=RequestLine.attempts + 1,
        )
        .returning(
            RequestLine.id,
            RequestLine.batch_id,
            RequestLine.custom_id,
            RequestLine.line_json,
            RequestLine.attempts,
        )
    ).all()
    claimed = [ClaimedRequest(*row) for row in rows]
    claimed.sort(key=lambda r: r.id)
    return claimed


def write_results(session: Session, owner: str, results: Sequence[dict[str, Any]]) -> None:
    """Store finished rows. Each dict: ``id``, ``status`` (succeeded/failed/cancelled),
    ``status_code``, ``result`` (the output or error line), ``prompt_tokens``,
    ``cached_tokens``, ``completion_tokens``, ``finished_at``. Only rows this owner still holds
    are written, so a worker whose lease was taken over cannot write a second result."""
    if not results:
        return
    statement = (
        update(RequestLine)
        .where(
            RequestLine.id == bindparam("row_id"),
            RequestLine.lease_owner == owner,
            RequestLine.status == "running",
        )
        .values(
            status=bindparam("new_status"),
            status_code=bindparam("status_code"),
            result=bindparam("result"),
            prompt_tokens=bindparam("prompt_tokens"),
            cached_tokens=bindparam("cached_tokens"),
            completion_tokens=bindparam("completion_tokens"),
            finished_at=bindparam("finished_at"),
            lease_owner=None,
            lease_expires_at=None,
        )
    )
    params = [
        {
            "row_id": r["id"],
            "new_status": r["status"],
            "status_code": r.get("status_code"),
            "result": r.get("result"),
            "prompt_tokens": r.get("prompt_tokens", 0),
            "cached_tokens": r.get("cached_tokens", 0),
            "completion_tokens": r.get("completion_tokens", 0),
            "finished_at": r.get("finished_at"),
        }
        for r in results
    ]
    session.connection().execute(statement, params)


def renew_leases(session: Session, owner: str, lease_until: float) -> None:
    """Heartbeat: extend every running row this owner holds."""
    session.execute(
        update(RequestLine)
        .where(RequestLine.lease_owner == owner, RequestLine.status == "running")
        .values(lease_expires_at=lease_until)
    )


def release(session: Session, owner: str, ids: Iterable[int]) -> None:
    """Give rows back to ``pending`` (they did not finish here and will run again)."""
    id_list = list(ids)
    if not id_list:
        return
    session.execute(
        update(RequestLine)
        .where(
            RequestLine.id.in_(id_list),
            RequestLine.lease_owner == owner,
            RequestLine.status == "running",
        )
        .values(status="pending", lease_owner=None, lease_expires_at=None)
    )


def end_unfinished(session: Session, batch_id: str, status: str, at: float) -> int:
    """Mark rows that will never run (``cancelled`` or ``expired``): every pending row and every
    running row whose lease ran out. Returns the number of rows changed."""
    result = session.execute(
        update(RequestLine)
        .where(
            RequestLine.batch_id == batch_id,
            or_(
                RequestLine.status == "pending",
                (RequestLine.status == "running") & (RequestLine.lease_expires_at < at),
            ),
        )
        .values(status=status, lease_owner=None, lease_expires_at=None, finished_at=at)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount or 0)


def iter_finished(
    session: Session, batch_id: str, batch_size: int = 2000
) -> Iterator[tuple[str, str, str | None]]:
    """``(custom_id, status, result)`` of every row of the batch in line order, streamed from a
    server-side cursor so a 50,000-line batch is never in memory at once."""
    query = (
        select(RequestLine.custom_id, RequestLine.status, RequestLine.result)
        .where(RequestLine.batch_id == batch_id)
        .order_by(RequestLine.line)
        .execution_options(stream_results=True, yield_per=batch_size)
    )
    for row in session.execute(query):
        yield row[0], row[1], row[2]
