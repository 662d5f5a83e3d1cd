"""The scheduler's reads and writes: shared state (the admin pause switch, load readings), the
backlog and throughput behind each batch's slack, the estimates shown on batches, and worker
heartbeats.

The ``scheduler_state`` keys and values are defined in ``offpeak.scheduler_state``. The pause
switch is turned on and off here (``pause``, ``resume``), for the admin API and ``offpeak pause``
alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import CursorResult, bindparam, delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from offpeak.scheduler_state import (
    ALL_POOLS,
    LOAD_PREFIX,
    PAUSE_ALL_KEY,
    PAUSE_PREFIX,
    PauseSwitch,
    parse_key,
    pause_key,
    pause_value,
    paused_of,
)
from offpeak.statuses import BatchStatus, LineStatus
from storage.models import Batch, EngineChunk, RequestLine, SchedulerState, WorkerRecord

# --- Shared state -----------------------------------------------------------------------------


def get_states(session: Session, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``key → value`` for the keys that exist."""
    key_list = list(keys)
    if not key_list:
        return {}
    rows = session.execute(
        select(SchedulerState.key, SchedulerState.value).where(SchedulerState.key.in_(key_list))
    )
    return {key: value for key, value in rows}


def states_with_prefix(session: Session, prefix: str) -> dict[str, tuple[dict[str, Any], float]]:
    """``key → (value, updated_at)`` of every key starting with ``prefix``."""
    rows = session.execute(
        select(SchedulerState.key, SchedulerState.value, SchedulerState.updated_at).where(
            SchedulerState.key.startswith(prefix)
        )
    )
    return {key: (value, updated_at) for key, value, updated_at in rows}


def put_state(session: Session, key: str, value: dict[str, Any], at: float) -> None:
    """Create or replace ``key`` (``at``: unix seconds) in one statement.

    An upsert (``INSERT … ON CONFLICT DO UPDATE``), not a read then a write: two writers of one
    key (overlapping admin pause calls, engine workers of one pool storing load readings) would
    otherwise both insert (a unique violation) or update a row a concurrent resume just deleted.
    PostgreSQL and SQLite only, the two databases Offpeak runs on.
    """
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = insert(SchedulerState).values(key=key, value=value, updated_at=at)
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[SchedulerState.key],
            set_={"value": statement.excluded.value, "updated_at": statement.excluded.updated_at},
        )
    )


def delete_state(session: Session, key: str) -> bool:
    """Remove ``key``; whether it existed."""
    result = cast(
        CursorResult[Any],
        session.execute(
            delete(SchedulerState)
            .where(SchedulerState.key == key)
            .execution_options(synchronize_session=False)
        ),
    )
    return bool(result.rowcount)


# --- The admin pause switch -------------------------------------------------------------------


def pause(
    session: Session, pool: str | None, *, hard: bool, reason: str | None, at: float
) -> PauseSwitch:
    """Turn the switch of ``pool`` (``"*"``: every pool) on at ``at`` (unix seconds); idempotent
    (a second call only updates ``hard`` and ``reason``)."""
    put_state(session, pause_key(pool), pause_value(hard, reason, at), at)
    return PauseSwitch(pool=pool or ALL_POOLS, paused=True, hard=hard, reason=reason, updated_at=at)


def resume(session: Session, pool: str | None, at: float) -> PauseSwitch:
    """Turn the switch of ``pool`` off; idempotent. A pool paused by ``"*"`` stays paused until
    ``"*"`` resumes too (the answer says so in ``reason``)."""
    key = pause_key(pool)
    delete_state(session, key)
    still = None
    if key != PAUSE_ALL_KEY and paused_of(get_states(session, [PAUSE_ALL_KEY]).get(PAUSE_ALL_KEY)):
        still = "every pool is still paused ('*')"
    return PauseSwitch(
        pool=pool or ALL_POOLS, paused=still is not None, hard=False, reason=still, updated_at=at
    )


def switches(session: Session) -> list[PauseSwitch]:
    """Every stored switch, by key (``*`` first, then by pool)."""
    rows = session.execute(
        select(SchedulerState.key, SchedulerState.value, SchedulerState.updated_at).where(
            (SchedulerState.key == PAUSE_ALL_KEY) | SchedulerState.key.startswith(PAUSE_PREFIX)
        )
    )
    return [
        PauseSwitch.of(parsed.pool, value, updated_at)
        for key, value, updated_at in sorted(rows)
        if (parsed := parse_key(key)) is not None
    ]


def load_readings(session: Session) -> list[tuple[str, Any, float]]:
    """``(pool, value, updated_at)`` of every pool's last load reading, by pool."""
    rows = session.execute(
        select(SchedulerState.key, SchedulerState.value, SchedulerState.updated_at).where(
            SchedulerState.key.startswith(LOAD_PREFIX)
        )
    )
    return [
        (parsed.pool, value, updated_at)
        for key, value, updated_at in sorted(rows)
        if (parsed := parse_key(key)) is not None
    ]


# --- Backlog, throughput and estimates --------------------------------------------------------


@dataclass(frozen=True)
class BatchBacklog:
    """A running batch as the slack sees it: its deadline and how much is left.

    Counts come from the batch row, which every flush keeps current (``refresh_counts``), so no
    request row is read. ``output_tokens / completed`` is the batch's own tokens per line so far.
    """

    batch_id: str
    expires_at: float
    window_seconds: int
    total: int
    completed: int
    failed: int
    output_tokens: int

    @property
    def remaining(self) -> int:
        """Lines not finished yet (pending or running)."""
        return max(0, self.total - self.completed - self.failed)


def backlog(session: Session, model: str) -> list[BatchBacklog]:
    """Every ``in_progress`` batch of ``model``, earliest deadline first."""
    rows = session.execute(
        select(
            Batch.id,
            Batch.expires_at,
            Batch.window_seconds,
            Batch.total,
            Batch.completed,
            Batch.failed,
            Batch.output_tokens,
        )
        .where(Batch.model == model, Batch.status == BatchStatus.IN_PROGRESS)
        .order_by(Batch.expires_at, Batch.id)
    )
    return [BatchBacklog(*row) for row in rows]


@dataclass(frozen=True)
class EngineHistory:
    """Engine chunks of one model since some time: tokens, busy seconds and the device."""

    requests: int
    completion_tokens: int
    busy_seconds: float
    device: str | None


def engine_history(session: Session, model: str, since: float) -> EngineHistory:
    """Totals of ``model``'s engine chunks that ended at or after ``since`` (unix seconds)."""
    row = session.execute(
        select(
            func.coalesce(func.sum(EngineChunk.requests), 0),
            func.coalesce(func.sum(EngineChunk.completion_tokens), 0),
            func.coalesce(func.sum(EngineChunk.busy_seconds), 0.0),
            func.max(EngineChunk.device),
        ).where(EngineChunk.model == model, EngineChunk.ended_at >= since)
    ).one()
    return EngineHistory(int(row[0]), int(row[1]), float(row[2]), row[3])


def set_estimates(session: Session, estimates: Mapping[str, float | None]) -> None:
    """Store ``batch_id → estimated_completion_at`` (unix seconds, or ``None``), skipping a
    batch whose row another transaction holds (a write-back's counters, a finalize): the
    estimate is refreshed every ``scheduler.estimate_seconds``, so the next one stores it, and
    the runner's loop, which saves them, never waits on a row lock (a wait behind a finalize
    stalls it, ``offpeak bench control``)."""
    if not estimates:
        return
    free = (
        select(Batch.id)
        .where(Batch.id == bindparam("batch_id"))
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    statement = (
        update(Batch).where(Batch.id == free).values(estimated_completion_at=bindparam("eta"))
    )
    session.connection().execute(
        statement, [{"batch_id": b, "eta": eta} for b, eta in estimates.items()]
    )


def not_held(session: Session, owner: str, ids: Iterable[int]) -> list[int]:
    """Those of ``ids`` that ``owner`` no longer holds (its lease lapsed and another worker took
    the line, or the line ended): the owner should stop running them."""
    id_list = list(ids)
    if not id_list:
        return []
    held = select(RequestLine.id).where(
        RequestLine.id.in_(id_list),
        RequestLine.lease_owner == owner,
        RequestLine.status == LineStatus.RUNNING,
    )
    return sorted(set(id_list) - set(session.scalars(held)))


# --- Workers ----------------------------------------------------------------------------------


def heartbeat(session: Session, worker_id: str, at: float) -> None:
    """Mark a registered worker alive at ``at`` (no-op for one never registered)."""
    session.execute(
        update(WorkerRecord)
        .where(WorkerRecord.id == worker_id)
        .values(heartbeat_at=at)
        .execution_options(synchronize_session=False)
    )


def live_workers(session: Session, model: str, since: float) -> int:
    """Ready workers serving ``model`` whose heartbeat is at or after ``since``."""
    rows = session.scalars(
        select(WorkerRecord.models).where(
            WorkerRecord.ready.is_(True), WorkerRecord.heartbeat_at >= since
        )
    )
    return sum(1 for models in rows if model in (models or []))


@dataclass(frozen=True)
class RunningBatch:
    """A running batch with the scheduler's estimate, for the admin view."""

    batch_id: str
    model: str | None
    expires_at: int
    estimated_completion_at: float | None
    total: int
    completed: int
    failed: int


def running_batches(session: Session, limit: int = 500) -> list[RunningBatch]:
    """Up to ``limit`` ``in_progress`` batches, earliest deadline first."""
    rows = session.execute(
        select(
            Batch.id,
            Batch.model,
            Batch.expires_at,
            Batch.estimated_completion_at,
            Batch.total,
            Batch.completed,
            Batch.failed,
        )
        .where(Batch.status == BatchStatus.IN_PROGRESS)
        .order_by(Batch.expires_at, Batch.id)
        .limit(limit)
    )
    return [RunningBatch(*row) for row in rows]
