"""Request lines: claims with leases, results, and streaming reads for the files (their intake
is ``storage.repositories.intake``).

Claims use ``SELECT … FOR UPDATE SKIP LOCKED`` on PostgreSQL so several workers take disjoint
chunks without waiting on each other; a claim is a lease (owner, expiry) that a heartbeat renews
and that another worker may take over once it has run out.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

from sqlalchemy import CursorResult, bindparam, or_, select, update
from sqlalchemy.orm import Session

from offpeak.statuses import BatchStatus, LineStatus
from storage.db import driver_connection, is_postgres
from storage.models import Batch, RequestLine
from storage.repositories import batches as batches_repo

#: The batches whose lines a claim may take: in progress and not paused.
CLAIMABLE = (Batch.status == BatchStatus.IN_PROGRESS, Batch.paused_at.is_(None))


@dataclass(frozen=True)
class TokenCounts:
    """Tokens of one finished request line: prompt (of them ``cached`` served from the prefix
    cache) and completion, summed over its ``n`` completions."""

    prompt: int = 0
    cached: int = 0
    completion: int = 0


@dataclass(frozen=True)
class FinishedLine:
    """A request line's end, as ``write_results`` stores it.

    ``status``: ``succeeded`` / ``failed`` (``status_code`` and ``result``: the output or error
    line) or ``cancelled`` / ``expired`` (never ran: no result). ``finished_at``: unix seconds.
    """

    id: int
    batch_id: str
    status: str
    finished_at: float
    status_code: int | None = None
    result: str | None = None
    tokens: TokenCounts = TokenCounts()


@dataclass(frozen=True)
class ClaimedRequest:
    id: int
    batch_id: str
    custom_id: str
    line_json: str
    attempts: int
    #: ``RequestLine.prefix_group``: the claim's order; the runner keeps a group together.
    prefix_group: int = 0


def claim(
    session: Session,
    *,
    model: str,
    limit: int,
    owner: str,
    lease_until: float,
    at: float,
    batch_ids: Collection[str] | None = None,
) -> list[ClaimedRequest]:
    """Take up to ``limit`` runnable request rows of ``model``, earliest deadline first and, at
    one deadline, prefix group by prefix group (``RequestLine.prefix_group``, so the engine gets a
    group's lines while their shared prefix is cached), in file order within one: pending
    rows, and running rows whose lease ran out before ``at`` (their worker died). Rows of batches
    not ``in_progress``, or whose window ended at ``at``, are left alone (the sweep expires them).
    ``batch_ids``: only rows of these batches (the urgent ones while load is high). Skips rows
    another transaction holds. Returns them in id order.

    Two range scans of ``ix_requests_claim`` (model, status, deadline, prefix_group, id)
    instead of one ``pending OR (running AND lease lapsed)``, which cannot walk that index in
    deadline order; and an integer bound on the bigint ``deadline`` (a float one casts every
    row). Rows with a lapsed lease come first (few: what workers hold), then pending rows in
    deadline order.

    On PostgreSQL the claim is one statement (``CLAIM_STATEMENTS``: both scans as the arms of a
    ``UNION ALL`` under one ``LIMIT``, so the pending scan locks only the rows the lapsed one left
    room for), pipelined with the transaction's ``BEGIN`` and planner setting: round trips pace
    the claim thread (``offpeak bench control``). Sorts are off for the claim's transaction:
    stale statistics cannot pick a sort over the walk (tests/integration/test_claim_plan.py)."""
    # deadline is whole seconds: deadline > at  <=>  deadline > floor(at), an integer bound.
    after = math.floor(at)
    if is_postgres(session):
        return _claim_pg(session, _claim_params(model, limit, owner, lease_until, at, batch_ids))
    running = set(session.scalars(select(Batch.id).where(*CLAIMABLE)))
    if batch_ids is not None:
        running &= set(batch_ids)
    if not running:
        return []
    ids = sorted(running)
    lease = (owner, lease_until)
    claimed = _take(session, model, LineStatus.RUNNING, after, limit, ids, lease, at)
    if len(claimed) < limit:
        rest = limit - len(claimed)
        claimed += _take(session, model, LineStatus.PENDING, after, rest, ids, lease)
    claimed.sort(key=lambda r: r.id)
    return claimed


#: The claim's planner setting on PostgreSQL, for its transaction only: a plan with a sort is
#: then the last resort. With statistics from before a large batch was copied in (autovacuum
#: not yet come by), PostgreSQL took the batch's rows as few, read them all by another index and
#: sorted them on every claim.
NO_SORTS = "SET LOCAL enable_sort = off"


def _claim_arm(status: str, lapsed: bool, only: bool) -> str:
    """One locking, ordered range scan of ``ix_requests_claim`` for ``CLAIM_STATEMENTS``."""
    return (
        "SELECT id FROM requests WHERE model = %(model)s AND status = '" + status + "' "
        "AND deadline > %(after)s "
        # An array of the running batches, not a join: joined, the planner sorted every pending
        # row of the model instead of walking the index.
        "AND batch_id = ANY(ARRAY(SELECT id FROM batches WHERE status = 'in_progress' "
        "AND paused_at IS NULL)) "
        + ("AND batch_id = ANY(%(only)s::varchar[]) " if only else "")
        + ("AND lease_expires_at < %(at)s " if lapsed else "")
        + "ORDER BY deadline, prefix_group, id LIMIT %(limit)s FOR UPDATE SKIP LOCKED"
    )


def _claim_statement(only: bool) -> str:
    # ``id = ANY(ARRAY(subquery))``: the ids picked once (an InitPlan), then looked up by
    # primary key; as ``id IN (subquery)`` the planner hash-joined a scan of the whole table.
    return (
        "UPDATE requests SET status = 'running', lease_owner = %(owner)s, "
        "lease_expires_at = %(lease_until)s, attempts = attempts + 1 "
        "WHERE id = ANY(ARRAY("
        f"SELECT id FROM ({_claim_arm(LineStatus.RUNNING, True, only)}) AS lapsed "
        f"UNION ALL SELECT id FROM ({_claim_arm(LineStatus.PENDING, False, only)}) AS pending "
        "LIMIT %(limit)s)) "
        "RETURNING id, batch_id, custom_id, line_json, attempts, prefix_group"
    )


#: ``claim``'s statement on PostgreSQL, by whether it is limited to some batches (``only``).
CLAIM_STATEMENTS = {only: _claim_statement(only) for only in (False, True)}


def _claim_params(
    model: str,
    limit: int,
    owner: str,
    lease_until: float,
    at: float,
    batch_ids: Collection[str] | None = None,
) -> dict[str, Any]:
    """``CLAIM_STATEMENTS[batch_ids is not None]``'s parameters for ``claim``'s arguments."""
    params: dict[str, Any] = {
        "model": model,
        "after": math.floor(at),
        "at": at,
        "limit": limit,
        "owner": owner,
        "lease_until": lease_until,
    }
    if batch_ids is not None:
        params["only"] = sorted(batch_ids)
    return params


def _claim_pg(session: Session, params: dict[str, Any]) -> list[ClaimedRequest]:
    raw = driver_connection(session)
    with raw.pipeline(), raw.cursor() as cursor:
        raw.execute(NO_SORTS)
        # A generic plan cannot see the batch list or the limit.
        cursor.execute(CLAIM_STATEMENTS["only" in params], params, prepare=False)
        rows = cursor.fetchall()
    claimed = [ClaimedRequest(*row) for row in rows]
    claimed.sort(key=lambda r: r.id)
    return claimed


def _take(
    session: Session,
    model: str,
    status: str,
    after: int,
    limit: int,
    batch_ids: list[str],
    lease: tuple[str, float],
    lapsed_before: float | None = None,
) -> list[ClaimedRequest]:
    """Lease up to ``limit`` rows of ``model`` in ``status`` with ``deadline > after`` in the
    batches ``batch_ids``, in deadline order; with ``lapsed_before`` only rows whose lease ran
    out before it (SQLite: ``claim`` on PostgreSQL is one statement). One statement: the
    ordered range scan as the subquery of the UPDATE that leases the rows and returns them."""
    owner, lease_until = lease
    params: dict[str, Any] = {
        "p_model": model,
        "p_status": status,
        "p_after": after,
        "p_batch_ids": batch_ids,
        "p_limit": limit,
        "p_owner": owner,
        "p_lease_until": lease_until,
    }
    if lapsed_before is not None:
        params["p_lapsed_before"] = lapsed_before
    statement = _take_statement(lapsed_before is not None)
    # On the session's connection, not ``session.execute``: the ORM's bulk-update path
    # (``synchronize_session``, its result handling) cost 2-3x the rows' own decoding, and
    # nothing here needs the identity map.
    rows = session.connection().execute(statement, params).all()
    return [ClaimedRequest(*row) for row in rows]


@cache
def _take_statement(lapsed: bool) -> Any:
    """``_take``'s statement, built once per kind with its values as bound parameters (building
    it per claim was a visible share of an engine worker's CPU)."""
    picked = (
        select(RequestLine.id)
        .where(
            RequestLine.model == bindparam("p_model"),
            RequestLine.status == bindparam("p_status"),
            RequestLine.deadline > bindparam("p_after"),
            RequestLine.batch_id.in_(bindparam("p_batch_ids", expanding=True)),
        )
        .order_by(RequestLine.deadline, RequestLine.prefix_group, RequestLine.id)
        .limit(bindparam("p_limit"))
    )
    if lapsed:
        picked = picked.where(RequestLine.lease_expires_at < bindparam("p_lapsed_before"))
    return lease_statement(picked, bindparam("p_owner"), bindparam("p_lease_until"))


def lease_statement(picked: Any, owner: Any, lease_until: Any) -> Any:
    """The ``UPDATE`` that leases the rows ``picked`` (a select of ids) to ``owner`` until
    ``lease_until`` (values or bound parameters), counting an attempt, and returns each row's
    ``ClaimedRequest`` fields."""
    return (
        update(RequestLine)
        .where(RequestLine.id.in_(picked))
        .values(
            status=LineStatus.RUNNING,
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
            RequestLine.prefix_group,
        )
        .execution_options(synchronize_session=False)
    )


def has_pending(session: Session, model: str) -> bool:
    """Whether ``model`` has a pending line in a batch that is ``in_progress`` and not paused
    (work a second engine worker could start on)."""
    pending = select(RequestLine.id).where(
        RequestLine.model == model,
        RequestLine.status == LineStatus.PENDING,
        RequestLine.batch_id.in_(select(Batch.id).where(*CLAIMABLE)),
    )
    return bool(session.scalar(select(pending.exists())))


def write_results(session: Session, owner: str, results: Sequence[FinishedLine]) -> set[int]:
    """Store finished rows; returns the ids written. Only rows this owner still holds are
    written, so a worker whose lease was taken over cannot write a second result (nor, through
    the returned ids, bill its engine time for it).

    PostgreSQL: one statement whatever the number of rows (``RESULTS_CTES``): an ``UPDATE … FROM
    unnest(arrays)`` whose rows actually written advance the batches' counters in the same
    statement; the planner's nested loops and bitmap scans stay off for the rest of the caller's
    transaction
    (``RESULTS_PLANNER_SETTINGS``).
    Elsewhere: an ``executemany``; ``refresh_counts`` recounts.
    """
    if not results:
        return set()
    if is_postgres(session):
        return _write_results_unnest(session, owner, results)
    # One writer at a time on SQLite: the rows selected here stay this owner's until the update.
    held = set(
        session.scalars(
            select(RequestLine.id).where(
                RequestLine.id.in_([r.id for r in results]),
                RequestLine.lease_owner == owner,
                RequestLine.status == LineStatus.RUNNING,
            )
        )
    )
    statement = (
        update(RequestLine)
        .where(
            RequestLine.id == bindparam("row_id"),
            RequestLine.lease_owner == owner,
            RequestLine.status == LineStatus.RUNNING,
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
            finished_seq=_finished_seq(),
        )
    )
    params = [
        {
            "row_id": r.id,
            "new_status": r.status,
            "status_code": r.status_code,
            "result": r.result,
            "prompt_tokens": r.tokens.prompt,
            "cached_tokens": r.tokens.cached,
            "completion_tokens": r.tokens.completion,
            "finished_at": r.finished_at,
        }
        for r in results
        if r.id in held
    ]
    if params:
        session.connection().execute(statement, params)
        batches_repo.next_results_seq(session, {r.batch_id for r in results if r.id in held})
    return held


def _finished_seq() -> Any:
    """``requests.finished_seq`` for the rows an ``UPDATE`` ends: their batch's next
    ``results_seq``, which the caller advances (``batches.next_results_seq``) under the
    batch's row lock."""
    return select(Batch.results_seq + 1).where(Batch.id == RequestLine.batch_id).scalar_subquery()


#: The results' ``UPDATE`` (fenced on the lease: only rows ``%(owner)s`` still runs; each takes
#: its batch's next ``results_seq``, the batches locked first by ``batches.LOCK_FOR_RESULTS``),
#: the rows it moved in ``written``, then the batches' counters (``batches.COUNTERS_CTES``): the
#: ``WITH`` list of one statement, so the counters cost no round trip. Each column travels as one
#: text parameter the server splits (``results_params``): psycopg dumps a list element by element in
#: Python, several times the CPU a line of one joined string (``offpeak bench control``).
RESULTS_CTES = f"""
    written AS (
        UPDATE requests AS q
        SET status = r.status, status_code = r.status_code, result = r.result,
            prompt_tokens = r.prompt_tokens, cached_tokens = r.cached_tokens,
            completion_tokens = r.completion_tokens, finished_at = r.finished_at,
            lease_owner = NULL, lease_expires_at = NULL, finished_seq = b.results_seq + 1
        FROM unnest(
            %(ids)s::bigint[], %(statuses)s::varchar[], %(status_codes)s::integer[],
            string_to_array(%(results)s, E'\\x1e', E'\\x1f'), %(prompt_tokens)s::integer[],
            %(cached_tokens)s::integer[], %(completion_tokens)s::integer[],
            %(finished_at)s::double precision[]
        ) AS r(id, status, status_code, result, prompt_tokens, cached_tokens, completion_tokens,
               finished_at), batches AS b
        WHERE q.id = ANY(%(ids)s::bigint[]) AND q.id = r.id AND q.lease_owner = %(owner)s
            AND q.status = 'running' AND b.id = q.batch_id
        RETURNING q.id, q.batch_id, q.status, q.prompt_tokens, q.cached_tokens,
            q.completion_tokens
    ),{batches_repo.COUNTERS_CTES}"""

#: The results' planner settings, until the transaction ends (the write-back's other statements
#: look rows up by key and join nothing, so setting them back would only cost a round trip):
#: never a nested loop for the results' join: the planner's statistics see few rows "running"
#: for this owner (estimated 1), so it nests the unnest inside the requests scan and rescans the
#: arrays once per row, which is many times slower than the hash join. And no bitmap scans: the
#: rows are found by ``id = ANY(ids)`` on the primary key, and a bitmap of the indexes on status
#: (keyed on it, so every version of a row that ran keeps an entry there until vacuum) read the
#: batch's every line that had run, on every write: a drain's time grew with its lines squared.
RESULTS_PLANNER_SETTINGS = (
    "SELECT set_config('enable_nestloop', 'off', true), "
    "set_config('enable_bitmapscan', 'off', true)"
)


def results_params(owner: str, results: Sequence[FinishedLine]) -> dict[str, Any]:
    """``RESULTS_CTES``' parameters: ``results`` as columns, and their ``owner``. Numbers and
    statuses as array literals (``_array_literal``); the results joined by ``_RESULT_SEPARATOR``
    (``_joined_texts``). Raises ``ValueError`` for a result that is not JSON text."""
    return {
        "ids": _array_literal([r.id for r in results]),
        "statuses": _array_literal([r.status for r in results]),
        "status_codes": _array_literal([r.status_code for r in results]),
        "results": _joined_texts([r.result for r in results]),
        "prompt_tokens": _array_literal([r.tokens.prompt for r in results]),
        "cached_tokens": _array_literal([r.tokens.cached for r in results]),
        "completion_tokens": _array_literal([r.tokens.completion for r in results]),
        "finished_at": _array_literal([r.finished_at for r in results]),
        "owner": owner,
    }


#: ``RESULTS_CTES`` splits the results' parameter at this character and reads a field of just
#: ``_NULL_RESULT`` as NULL (``string_to_array``). Both are ASCII control characters, which JSON
#: text, every stored result (``offpeak.endpoints.records``), never holds unescaped (RFC 8259,
#: section 7).
_RESULT_SEPARATOR = "\x1e"
_NULL_RESULT = "\x1f"


def _array_literal(values: list[Any]) -> str:
    """``values`` as a PostgreSQL array literal (``NULL`` for ``None``): numbers, or statuses,
    whose text holds no quote, comma, brace, backslash or space to escape."""
    if None in values:
        return "{" + ",".join("NULL" if v is None else str(v) for v in values) + "}"
    return "{" + ",".join(map(str, values)) + "}"


def _joined_texts(values: list[str | None]) -> str:
    """``values`` joined by ``_RESULT_SEPARATOR``, ``None`` as ``_NULL_RESULT``. Raises
    ``ValueError`` when one holds the separator (not JSON text: a bug upstream)."""
    joined = _RESULT_SEPARATOR.join(_NULL_RESULT if v is None else v for v in values)
    if values and (joined.count(_RESULT_SEPARATOR) != len(values) - 1 or _NULL_RESULT in values):
        raise ValueError("a result to store is not JSON text: it holds a control character")
    return joined


def _write_results_unnest(
    session: Session, owner: str, results: Sequence[FinishedLine]
) -> set[int]:
    raw = driver_connection(session)
    # One round trip for the transaction's BEGIN, the setting and the statement (psycopg's
    # pipeline mode). Never a prepared statement: a generic plan cannot see the arrays' length.
    with raw.pipeline(), raw.cursor() as cursor:
        raw.execute(RESULTS_PLANNER_SETTINGS)
        raw.execute(batches_repo.LOCK_FOR_RESULTS, {"ids": sorted({r.batch_id for r in results})})
        cursor.execute(
            f"WITH {RESULTS_CTES} SELECT id, batch_id FROM written",
            results_params(owner, results),
            prepare=False,
        )
        written = cursor.fetchall()
    batches_repo.counts_current(session, {batch_id for _, batch_id in written})
    return {row_id for row_id, _ in written}


def renew_leases(session: Session, owner: str, lease_until: float, ids: Collection[int]) -> int:
    """Heartbeat: extend the leases of the running rows ``ids`` that ``owner`` still holds;
    returns how many. Only the lines the worker holds in memory: a row it failed to hand back
    (the database was down) must lapse and run elsewhere, not be renewed forever."""
    id_list = list(ids)
    if not id_list:
        return 0
    result = cast(
        CursorResult[Any],
        session.execute(
            update(RequestLine)
            .where(
                RequestLine.id.in_(id_list),
                RequestLine.lease_owner == owner,
                RequestLine.status == LineStatus.RUNNING,
            )
            .values(lease_expires_at=lease_until)
            .execution_options(synchronize_session=False)
        ),
    )
    return int(result.rowcount or 0)


def release(session: Session, owner: str, ids: Iterable[int], *, count_attempt: bool = True) -> int:
    """Give rows this owner holds back to ``pending`` (they did not finish here and will run
    again); returns how many. ``count_attempt=False`` takes back the attempt their claim counted,
    for rows handed back unrun or aborted on purpose (the scheduler yielding to real-time load),
    so ``attempts`` keeps counting only runs that crashed or failed."""
    id_list = list(ids)
    if not id_list:
        return 0
    values: dict[str, Any] = {
        "status": LineStatus.PENDING,
        "lease_owner": None,
        "lease_expires_at": None,
    }
    if not count_attempt:
        values["attempts"] = RequestLine.attempts - 1
    result = cast(
        CursorResult[Any],
        session.execute(
            update(RequestLine)
            .where(
                RequestLine.id.in_(id_list),
                RequestLine.lease_owner == owner,
                RequestLine.status == LineStatus.RUNNING,
            )
            .values(**values)
            .execution_options(synchronize_session=False)
        ),
    )
    return int(result.rowcount or 0)


def end_unfinished(session: Session, batch_id: str, status: str, at: float) -> int:
    """Mark rows that will never run (``cancelled`` or ``expired``): every pending row and every
    running row whose lease ran out. Returns the number of rows changed."""
    result = cast(
        CursorResult[Any],
        session.execute(
            update(RequestLine)
            .where(
                RequestLine.batch_id == batch_id,
                or_(
                    RequestLine.status == LineStatus.PENDING,
                    (RequestLine.status == LineStatus.RUNNING)
                    & (RequestLine.lease_expires_at < at),
                ),
            )
            .values(
                status=status,
                lease_owner=None,
                lease_expires_at=None,
                finished_at=at,
                finished_seq=_finished_seq(),
            )
            .execution_options(synchronize_session=False)
        ),
    )
    batches_repo.next_results_seq(session, [batch_id])
    return int(result.rowcount or 0)


def iter_finished(
    session: Session, batch_id: str, batch_size: int = 2000
) -> Iterator[tuple[str, str, str | None]]:
    """``(custom_id, status, result)`` of every row of the batch in line order, streamed from a
    server-side cursor so a 50,000-line batch is never in memory at once. PostgreSQL: the
    driver's own named cursor, ``batch_size`` rows a fetch, the rows as it returns them
    (the ORM's result rows cost finalize more per line)."""
    if is_postgres(session):
        yield from _iter_finished_pg(session, batch_id, batch_size)
        return
    query = (
        select(RequestLine.custom_id, RequestLine.status, RequestLine.result)
        .where(RequestLine.batch_id == batch_id)
        .order_by(RequestLine.line)
        .execution_options(stream_results=True, yield_per=batch_size)
    )
    for row in session.execute(query):
        yield row[0], row[1], row[2]


def _iter_finished_pg(
    session: Session, batch_id: str, batch_size: int
) -> Iterator[tuple[str, str, str | None]]:
    raw = driver_connection(session)
    with raw.cursor(name="offpeak_iter_finished") as cursor:
        cursor.itersize = batch_size
        cursor.execute(
            "SELECT custom_id, status, result FROM requests WHERE batch_id = %s ORDER BY line",
            (batch_id,),
        )
        yield from cursor


def iter_line_json(session: Session, batch_id: str, batch_size: int = 1000) -> Iterator[str]:
    """The request lines of a batch as uploaded (``line_json``), in no particular order, through
    a server-side cursor (PostgreSQL: the driver's named cursor, ``batch_size`` rows a fetch), so
    a 50,000-line batch is never in memory at once. Lines a worker is running are read as they
    are: nothing is locked."""
    if is_postgres(session):
        raw = driver_connection(session)
        with raw.cursor(name="offpeak_iter_line_json") as cursor:
            cursor.itersize = batch_size
            cursor.execute("SELECT line_json FROM requests WHERE batch_id = %s", (batch_id,))
            for (line_json,) in cursor:
                yield line_json
        return
    query = (
        select(RequestLine.line_json)
        .where(RequestLine.batch_id == batch_id)
        .execution_options(stream_results=True, yield_per=batch_size)
    )
    yield from session.scalars(query)
