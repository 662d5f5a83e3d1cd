"""Batches: lookups, status changes and the counters behind ``request_counts`` and ``usage``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Select, bindparam, event, func, select, update
from sqlalchemy.orm import Session, SessionTransaction

from offpeak.failure_limit import FailureLimit, exceeded
from offpeak.statuses import BatchStatus, LineStatus
from storage.db import Executor, PollQuery
from storage.models import Batch, RequestLine
from storage.repositories import billing as billing_repo


def add(session: Session, batch: Batch) -> Batch:
    session.add(batch)
    session.flush()
    return batch


def _of_tenant(tenant_id: str, batch_id: str) -> Select[Batch]:
    return select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id)


def get(session: Session, tenant_id: str, batch_id: str) -> Batch | None:
    return session.scalar(_of_tenant(tenant_id, batch_id))


#: The columns a status poll shows (``api.schemas.batches.batch_json``), named as ``Batch``'s
#: attributes, so the same code reads a row of them and a ``Batch``.
POLL_COLUMNS = (
    Batch.id, Batch.endpoint, Batch.model, Batch.errors, Batch.input_file_id,
    Batch.completion_window, Batch.status, Batch.output_file_id, Batch.error_file_id,
    Batch.created_at, Batch.in_progress_at, Batch.expires_at, Batch.finalizing_at,
    Batch.completed_at, Batch.failed_at, Batch.expired_at, Batch.cancelling_at,
    Batch.cancelled_at, Batch.total, Batch.completed, Batch.failed, Batch.input_tokens,
    Batch.cached_tokens, Batch.output_tokens, Batch.min_prompt_tokens,
    Batch.metadata_.label("metadata_"),
    Batch.estimated_completion_at, Batch.estimate, Batch.paused_at, Batch.failure_limit,
)  # fmt: skip

# Built once, with bound parameters (status polls run them): building a statement and its
# cache key each time cost more than executing it.
_POLL_ONE = PollQuery(
    billing_repo.with_bills(
        select(*POLL_COLUMNS).where(
            Batch.id == bindparam("batch_id"), Batch.tenant_id == bindparam("tenant_id")
        )
    )
)
_PAGE = billing_repo.with_bills(
    select(*POLL_COLUMNS)
    .where(Batch.tenant_id == bindparam("tenant_id"), Batch.endpoint != bindparam("endpoint"))
    .order_by(Batch.id.desc())
    .limit(bindparam("rows"))
)
_POLL_PAGE = PollQuery(_PAGE)
_POLL_PAGE_AFTER = PollQuery(_PAGE.where(Batch.id < bindparam("after")))
_OF_TENANT = select(Batch.id).where(
    Batch.id == bindparam("batch_id"), Batch.tenant_id == bindparam("tenant_id")
)


def poll_row(db: Executor, tenant_id: str, batch_id: str) -> dict[str, Any] | None:
    """The batch's ``POLL_COLUMNS`` and its bill's ``ledger.BILL_COLUMNS`` (NULL until billed)
    in one statement, by key; ``None`` for an unknown or another tenant's batch."""
    return _POLL_ONE.first(db, {"tenant_id": tenant_id, "batch_id": batch_id})


def poll_page(
    db: Executor, tenant_id: str, *, after: str | None, limit: int, exclude_endpoint: str
) -> list[dict[str, Any]]:
    """Up to ``limit + 1`` rows as ``poll_row``'s, newest first, older than the cursor
    ``after``, without the batches of ``exclude_endpoint`` (another API surface's), in one
    statement."""
    params: dict[str, Any] = {"tenant_id": tenant_id, "endpoint": exclude_endpoint}
    params["rows"] = limit + 1
    if after:
        params["after"] = after
    return (_POLL_PAGE_AFTER if after else _POLL_PAGE).all(db, params)


def is_of_tenant(db: Executor, tenant_id: str, batch_id: str) -> bool:
    """Whether ``batch_id`` is one of the tenant's batches (of any API surface)."""
    params = {"tenant_id": tenant_id, "batch_id": batch_id}
    return db.execute(_OF_TENANT, params).first() is not None


def get_for_update(
    session: Session,
    batch_id: str,
    skip_locked: bool = False,
    *,
    no_key: bool = False,
    refresh: bool = False,
) -> Batch | None:
    """The batch, row-locked until the transaction ends (tasks serialize on it). With
    ``skip_locked``, ``None`` when another transaction holds the lock.

    ``no_key``: PostgreSQL's ``FOR NO KEY UPDATE``, for a change of status only. It still
    serializes with every other status change, but not with the ``FOR KEY SHARE`` lock that
    inserting request rows takes on their batch (the foreign key's check), so it does not wait
    for a validation that copied rows in and has not committed yet. ``refresh``: re-read the row
    even if the session holds it (a status read before the lock may be stale).
    """
    query = select(Batch).where(Batch.id == batch_id)
    query = query.with_for_update(skip_locked=skip_locked, key_share=no_key)
    if refresh:
        query = query.execution_options(populate_existing=True)
    return session.scalar(query)


#: First key of the validation advisory locks (PostgreSQL's two-key form), so they cannot
#: collide with another use of advisory locks on the same database.
_VALIDATION_LOCK_SPACE = 0x0FF0_0001


def try_lock_validation(session: Session, batch_id: str) -> bool:
    """Take the batch's validation lock for the rest of the transaction; ``False`` when
    another transaction holds it (that one is validating the batch already).

    A PostgreSQL advisory lock rather than the batch row, so that a validation's long ``COPY``
    does not hold the row that a cancel must update. Elsewhere (SQLite, whose writers are
    serialized by the database) always ``True``.
    """
    if session.get_bind().dialect.name != "postgresql":
        return True
    key = func.hashtext(batch_id)
    return bool(session.scalar(select(func.pg_try_advisory_xact_lock(_VALIDATION_LOCK_SPACE, key))))


def lock(session: Session, batch_id: str) -> Batch | None:
    """The batch, fresh from the database and locked against every other writer until the
    transaction ends: ``FOR UPDATE`` on PostgreSQL; on SQLite, which ignores ``FOR UPDATE`` and
    lets two transactions read the same status, a no-op write first takes the database's write
    lock (waiting up to its ``busy_timeout``). For steps that must run once (finalize)."""
    if session.get_bind().dialect.name != "postgresql":
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(status=Batch.status)
            .execution_options(synchronize_session=False)
        )
    query = select(Batch).where(Batch.id == batch_id).with_for_update()
    return session.scalar(query.execution_options(populate_existing=True))


def get_any(session: Session, batch_id: str) -> Batch | None:
    return session.get(Batch, batch_id)


def set_estimate(session: Session, batch_id: str, estimate: dict[str, Any]) -> bool:
    """Store ``estimate`` as the batch's ``estimate`` unless it has one already (a redelivered
    task computes the same figures: the first one stays). Returns whether it was stored. Takes
    the batch row's lock for the moment of the ``UPDATE`` only (the caller commits at once)."""
    result = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.estimate.is_(None))
        .values(estimate=estimate)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0))


def statuses(session: Session, batch_ids: Iterable[str]) -> dict[str, tuple[str, int]]:
    """``batch_id → (status, expires_at)`` for the given batches."""
    ids = list(batch_ids)
    if not ids:
        return {}
    rows = session.execute(
        select(Batch.id, Batch.status, Batch.expires_at).where(Batch.id.in_(ids))
    )
    return {batch_id: (status, expires_at) for batch_id, status, expires_at in rows}


#: ``session.info`` key: batches whose counters this transaction already brought up to date.
_COUNTS_CURRENT = "offpeak.counts_current"

#: The batches' counters advanced by the rows a ``requests`` statement just wrote, as a
#: data-modifying CTE over that statement's ``written`` (``batch_id``, ``status`` and the
#: three token counts of each row it moved from ``running`` to a final status): one statement
#: with the results' ``UPDATE``, so no round trip of its own (``requests.RESULTS_CTES``). Each
#: line is added once: ``written`` holds only rows that statement moved out of ``running``.
#: ``sums`` (per batch: ``completed``, ``failed``, the token sums, and ``answered_*``: those of
#: the succeeded lines alone) is also what ``engine_chunks.CHUNK_CTES`` reads.
COUNTERS_CTES = """
    sums AS (
        SELECT batch_id,
            count(*) FILTER (WHERE status = 'succeeded') AS completed,
            count(*) FILTER (WHERE status <> 'succeeded') AS failed,
            sum(prompt_tokens) AS prompt_tokens, sum(cached_tokens) AS cached_tokens,
            sum(completion_tokens) AS completion_tokens,
            sum(prompt_tokens) FILTER (WHERE status = 'succeeded') AS answered_prompt,
            sum(cached_tokens) FILTER (WHERE status = 'succeeded') AS answered_cached,
            sum(completion_tokens) FILTER (WHERE status = 'succeeded') AS answered_completion
        FROM written GROUP BY batch_id
    ),
    counters AS (
        UPDATE batches AS b
        SET completed = b.completed + s.completed, failed = b.failed + s.failed,
            results_seq = b.results_seq + 1,
            input_tokens = b.input_tokens + s.prompt_tokens,
            cached_tokens = b.cached_tokens + s.cached_tokens,
            output_tokens = b.output_tokens + s.completion_tokens
        FROM sums AS s WHERE b.id = s.batch_id
    )"""


def counts_current(session: Session, batch_ids: Iterable[str]) -> None:
    """Note that ``batch_ids``' counters are up to date for the rest of the transaction (a
    ``COUNTERS_CTES`` statement advanced them), so ``refresh_counts`` need not read their rows
    again."""
    session.info.setdefault(_COUNTS_CURRENT, set()).update(batch_ids)


def min_prompt_tokens(session: Session, batch_id: str) -> int:
    """The least prompt tokens an engine could have computed for the batch's answered lines:
    their prompt tokens, with the shared prefix of each prefix group (``RequestLine.prefix_group``)
    counted once, that prefix taken as the most tokens any line of the group found in the prefix
    cache (whole KV blocks, so at most a block short of the text they share), and what every line
    of the group found cached (a prefix shared with other groups: a chat template's start, a
    system prompt) not at all."""
    per_group = (
        select(
            func.sum(RequestLine.prompt_tokens).label("prompt"),
            func.count().label("lines"),
            func.max(RequestLine.cached_tokens).label("shared"),
            func.min(RequestLine.cached_tokens).label("common"),
        )
        .where(RequestLine.batch_id == batch_id, RequestLine.status == LineStatus.SUCCEEDED)
        .group_by(RequestLine.prefix_group)
        .subquery()
    )
    saved = (per_group.c.lines - 1) * per_group.c.shared + per_group.c.common
    total = session.scalar(select(func.coalesce(func.sum(per_group.c.prompt - saved), 0)))
    return max(0, int(total or 0))


def refresh_counts(session: Session, batch_ids: Iterable[str]) -> None:
    """Recompute ``request_counts`` and ``usage`` from the request rows, so the numbers a
    client polls always match the rows (and so the files written from them).

    Batches whose counters a ``COUNTERS_CTES`` statement already advanced in this transaction
    (``counts_current``) are skipped: they were exact when it began (every earlier transaction
    ended with exact counters) and only that statement changed them since, so recounting them
    would read every row of the batch again for the same numbers (at 50,000 lines, tens of
    milliseconds per flush).
    """
    current = session.info.get(_COUNTS_CURRENT, set())
    ids = sorted(set(batch_ids) - current)
    if not ids:
        return
    done = RequestLine.status.in_(LineStatus.ENDED)
    rows = session.execute(
        select(
            RequestLine.batch_id,
            func.count(),
            func.count().filter(RequestLine.status == LineStatus.SUCCEEDED),
            func.count().filter(done, RequestLine.status != LineStatus.SUCCEEDED),
            func.coalesce(func.sum(RequestLine.prompt_tokens), 0),
            func.coalesce(func.sum(RequestLine.cached_tokens), 0),
            func.coalesce(func.sum(RequestLine.completion_tokens), 0),
        )
        .where(RequestLine.batch_id.in_(ids))
        .group_by(RequestLine.batch_id)
    )
    counts = {row[0]: row[1:] for row in rows}
    session.connection().execute(
        update(Batch)
        .where(Batch.id == bindparam("batch_id"))
        .values(
            total=bindparam("n_total"),
            completed=bindparam("n_completed"),
            failed=bindparam("n_failed"),
            input_tokens=bindparam("n_input"),
            cached_tokens=bindparam("n_cached"),
            output_tokens=bindparam("n_output"),
        ),
        [
            dict(
                zip(
                    ("batch_id", "n_total", "n_completed", "n_failed", "n_input", "n_cached",
                     "n_output"),
                    (batch_id, *counts.get(batch_id, (0, 0, 0, 0, 0, 0))),
                    strict=True,
                )
            )
            for batch_id in ids
        ],
    )  # fmt: skip


@event.listens_for(Session, "after_transaction_end")
def _forget_current_counts(session: Session, transaction: SessionTransaction) -> None:
    # Only the outermost transaction: ``Session.flush`` opens and ends inner ones.
    if transaction.parent is None:
        session.info.pop(_COUNTS_CURRENT, None)


def unfinished_by_status(session: Session, batch_id: str) -> dict[str, int]:
    """Counts of this batch's request rows still ``pending`` or ``running``."""
    rows = session.execute(
        select(RequestLine.status, func.count())
        .where(RequestLine.batch_id == batch_id, RequestLine.status.in_(LineStatus.UNFINISHED))
        .group_by(RequestLine.status)
    )
    return {status: count for status, count in rows}


def window_left_work(session: Session, batch_id: str) -> bool:
    """Whether this batch has a line still ``pending`` or ``running``, or one already ended
    ``expired``: what makes a batch past its ``expires_at`` end ``expired`` rather than
    ``completed``."""
    statuses = (*LineStatus.UNFINISHED, LineStatus.EXPIRED)
    first = session.execute(
        select(RequestLine.id)
        .where(RequestLine.batch_id == batch_id, RequestLine.status.in_(statuses))
        .limit(1)
    )
    return first.first() is not None


def active_models(session: Session) -> list[str]:
    """Models with batches still running, for re-enqueueing work after a restart."""
    rows = session.scalars(
        select(Batch.model)
        .where(
            Batch.status.in_((BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)),
            Batch.model.is_not(None),
        )
        .distinct()
    )
    return [m for m in rows if m]


def finished_but_running(session: Session) -> list[str]:
    """``in_progress`` batches with no line left to run: their finalize message was lost."""
    open_lines = select(RequestLine.id).where(
        RequestLine.batch_id == Batch.id, RequestLine.status.in_(LineStatus.UNFINISHED)
    )
    query = select(Batch.id).where(Batch.status == BatchStatus.IN_PROGRESS, ~open_lines.exists())
    return list(session.scalars(query))


def ids_in_status(session: Session, status: str) -> list[str]:
    return list(session.scalars(select(Batch.id).where(Batch.status == status)))


def expired_ids(session: Session, at: int) -> list[str]:
    """Batches still running whose window ended at or before ``at`` (unix seconds)."""
    return list(
        session.scalars(
            select(Batch.id).where(
                Batch.status.in_((BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)),
                Batch.expires_at <= at,
            )
        )
    )


#: The breaker's check on PostgreSQL (``offpeak.failure_limit.exceeded`` in SQL): the batches of
#: ``%(ids)s`` still ``in_progress`` whose counters, as this transaction advanced them, trip
#: their ``failure_limit`` go to ``cancelling`` with ``failure_limit_reached_at`` = ``%(at)s``
#: (finalize then ends them ``failed``); their ids come back. A key lookup per batch.
TRIP_FAILURE_LIMITS = """
    UPDATE batches SET status = 'cancelling', cancelling_at = %(at)s,
        failure_limit_reached_at = %(at)s
    WHERE id = ANY(%(ids)s::varchar[]) AND status = 'in_progress' AND failure_limit IS NOT NULL
        AND completed + failed >= (failure_limit->>'after_lines')::bigint
        AND failed > (failure_limit->>'fraction')::float8 * (completed + failed)
    RETURNING id"""


def trip_failure_limits(session: Session, batch_ids: Iterable[str], at: int) -> list[str]:
    """``TRIP_FAILURE_LIMITS`` one batch at a time (SQLite, one writer at a time: the counters
    were just recounted by ``refresh_counts``); returns the ids of the batches it stopped."""
    tripped = []
    batches = session.scalars(
        select(Batch).where(
            Batch.id.in_(sorted(set(batch_ids))),
            Batch.status == BatchStatus.IN_PROGRESS,
            Batch.failure_limit.is_not(None),
        )
    )
    for batch in batches:
        if batch.failure_limit is None:  # stored before none_as_null: JSON null
            continue
        limit = FailureLimit.model_validate(batch.failure_limit)
        if exceeded(batch.completed + batch.failed, batch.failed, limit):
            batch.status = BatchStatus.CANCELLING
            batch.cancelling_at = batch.failure_limit_reached_at = at
            tripped.append(batch.id)
    session.flush()
    return tripped


def line_counts(session: Session, batch_id: str) -> dict[str, int]:
    """The batch's request rows by status."""
    rows = session.execute(
        select(RequestLine.status, func.count())
        .where(RequestLine.batch_id == batch_id)
        .group_by(RequestLine.status)
    )
    return {status: count for status, count in rows}


#: The batches ``%(ids)s`` row-locked until the transaction ends, in id order (so two writers
#: of the same batches cannot deadlock on them): a write that ends lines takes the batch's next
#: ``results_seq`` under this lock, so the numbers commit in the order they are taken.
LOCK_FOR_RESULTS = (
    "SELECT id FROM batches WHERE id = ANY(%(ids)s::varchar[]) ORDER BY id FOR NO KEY UPDATE"
)


def next_results_seq(session: Session, batch_ids: Iterable[str]) -> None:
    """Advance ``results_seq`` of ``batch_ids`` (after a write that ended lines of them with
    its old value + 1; SQLite and finalize, whose batch is locked already)."""
    ids = sorted(set(batch_ids))
    if ids:
        session.execute(
            update(Batch)
            .where(Batch.id.in_(ids))
            .values(results_seq=Batch.results_seq + 1)
            .execution_options(synchronize_session=False)
        )
