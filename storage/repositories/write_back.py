"""The runner's write-back: one transaction that stores finished lines (fenced on their lease),
advances their batches' counters, records the engine chunk they took, renews the leases of the
lines the worker still holds, stops the batches whose breaker the results tripped
(``offpeak.failure_limit``), marks the worker alive and reads the statuses of its batches.

On PostgreSQL it is one round trip (psycopg's pipeline mode), the results, counters and chunk
one statement (``requests.RESULTS_CTES``, ``engine_chunks.CHUNK_CTES``): the write-back paces
the runner when the engine answers at once (``offpeak bench control``). Elsewhere (SQLite) the
same steps run one statement at a time through the repositories' functions.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from storage.db import driver_connection, is_postgres
from storage.repositories import batches as batches_repo
from storage.repositories import engine_chunks
from storage.repositories import requests as requests_repo
from storage.repositories import scheduler as scheduler_repo
from storage.repositories.engine_chunks import EnginePeriod
from storage.repositories.requests import FinishedLine

#: PostgreSQL forms of ``requests.renew_leases`` (returning the ids still held, so the lines
#: lost are known without a second query, ``scheduler.not_held``), ``scheduler.heartbeat`` and
#: ``batches.statuses``, for the pipeline.
_RENEW = (
    "UPDATE requests SET lease_expires_at = %(lease_until)s WHERE id = ANY(%(held)b::bigint[]) "
    "AND lease_owner = %(owner)s AND status = 'running' RETURNING id"
)
_HEARTBEAT = "UPDATE workers SET heartbeat_at = %(at)s WHERE id = %(owner)s"
_STATUSES = "SELECT id, status, expires_at FROM batches WHERE id = ANY(%(ids)s::varchar[])"


@dataclass
class Stored:
    """What a write-back stored and read: ``written``, the ids of the results stored (the lines
    the owner still ran); ``held``, those of the held lines whose leases it renewed (the owner
    still runs them: the others were taken over or ended); ``statuses``, ``batch_id →
    (status, expires_at)`` of the batches asked about."""

    written: set[int]
    held: set[int]
    statuses: dict[str, tuple[str, int]]
    #: Batches whose breaker these results tripped (``batches.TRIP_FAILURE_LIMITS``).
    tripped: list[str] = field(default_factory=list)


def store(
    session: Session,
    results: Sequence[FinishedLine],
    period: EnginePeriod,
    *,
    lease_until: float,
    held_ids: Collection[int],
    batch_ids: Collection[str],
) -> Stored:
    """Store ``results`` of ``period.worker_id`` (only the rows it still holds), their batches'
    counters and the engine chunk of ``period`` (when any stored line succeeded); renew the
    leases of ``held_ids`` to ``lease_until`` (unix seconds); set the worker's heartbeat to
    ``period.ended_at``; read the statuses of ``batch_ids``. In the caller's transaction.
    Raises what the database raises (``sqlalchemy.exc.DBAPIError``; on PostgreSQL psycopg's
    errors, as ``requests.write_results``: a NUL in a result is a ``DataError``)."""
    if not is_postgres(session):
        return _store_stepwise(
            session, results, period, lease_until=lease_until, held_ids=held_ids,
            batch_ids=batch_ids,
        )  # fmt: skip
    owner = period.worker_id
    held = list(held_ids)
    raw = driver_connection(session)
    with (
        raw.pipeline(),
        raw.cursor() as written,
        raw.cursor() as tripped,
        raw.cursor() as renewed,
        raw.cursor() as statuses,
    ):
        raw.execute(requests_repo.RESULTS_PLANNER_SETTINGS)
        if results:
            ids = sorted({r.batch_id for r in results})
            raw.execute(batches_repo.LOCK_FOR_RESULTS, {"ids": ids})
            written.execute(
                f"WITH {requests_repo.RESULTS_CTES},{engine_chunks.CHUNK_CTES} "
                "SELECT id, batch_id FROM written",
                requests_repo.results_params(owner, results) | engine_chunks.period_params(period),
                # A generic plan cannot see the arrays' length.
                prepare=False,
            )
            # After the counters moved, before the statuses are read: a batch it stops reads
            # ``cancelling`` here, and the runner stops its lines at once.
            tripped.execute(
                batches_repo.TRIP_FAILURE_LIMITS,
                {"ids": ids, "at": int(period.ended_at)},
            )
        if held:
            renewed.execute(_RENEW, {"lease_until": lease_until, "held": held, "owner": owner})
        raw.execute(_HEARTBEAT, {"at": period.ended_at, "owner": owner})
        if batch_ids:
            statuses.execute(_STATUSES, {"ids": list(batch_ids)})
        rows = written.fetchall() if results else []
        stopped = [batch_id for (batch_id,) in tripped.fetchall()] if results else []
        still_held = {row_id for (row_id,) in renewed.fetchall()} if held else set()
        states = (
            {b: (status, expires_at) for b, status, expires_at in statuses.fetchall()}
            if batch_ids
            else {}
        )
    batches_repo.counts_current(session, {batch_id for _, batch_id in rows})
    # Only batches of results another worker took over are left to recount (rarely any).
    batches_repo.refresh_counts(session, {r.batch_id for r in results})
    return Stored({row_id for row_id, _ in rows}, still_held, states, stopped)


def _store_stepwise(
    session: Session,
    results: Sequence[FinishedLine],
    period: EnginePeriod,
    *,
    lease_until: float,
    held_ids: Collection[int],
    batch_ids: Collection[str],
) -> Stored:
    """``store`` one statement at a time (SQLite)."""
    owner = period.worker_id
    written = requests_repo.write_results(session, owner, results)
    per_batch = engine_chunks.tokens_by_batch(r for r in results if r.id in written)
    if per_batch:
        engine_chunks.record(
            session,
            worker_id=owner,
            model=period.model,
            device=period.device,
            started_at=period.started_at,
            ended_at=period.ended_at,
            busy_seconds=period.busy_seconds,
            per_batch=per_batch,
        )
    stopped = []
    if results:
        batches_repo.refresh_counts(session, {r.batch_id for r in results})
        stopped = batches_repo.trip_failure_limits(
            session, {r.batch_id for r in results}, int(period.ended_at)
        )
    held = set(held_ids)
    if requests_repo.renew_leases(session, owner, lease_until, held) < len(held):
        held -= set(scheduler_repo.not_held(session, owner, held))
    scheduler_repo.heartbeat(session, owner, period.ended_at)
    return Stored(written, held, batches_repo.statuses(session, batch_ids), stopped)
