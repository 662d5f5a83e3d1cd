"""Worker registrations: which models each worker serves, its role and its last heartbeat.

An engine worker announces itself while it loads its engines (``announce_loading``: readers give
it a grace period instead of an alarm). A worker registers once it is ready (an engine worker: its
engines are loaded), then marks itself
alive every few seconds (``heartbeat``); a clean stop ``retire``s it. A killed worker simply stops
beating: readers decide "alive" from the heartbeat's age, never from ``ready`` alone.
"""

from __future__ import annotations

import time

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from storage.models import WorkerRecord

#: Roles a worker record may carry (``control,engine``: one worker consuming both kinds of queue).
ROLES = ("control", "engine", "control,engine")


def register(
    session: Session, worker_id: str, hostname: str, models: list[str], role: str = "engine"
) -> None:
    """Record (or refresh) a worker that is ready: an engine worker whose engines are loaded, or
    a control worker consuming its queue. ``models``: the served model names ([] for control).

    Raises ``ValueError`` for a role not in ``ROLES``.
    """
    if role not in ROLES:
        raise ValueError(f"unknown worker role {role!r}")
    at = time.time()
    record = session.get(WorkerRecord, worker_id)
    if record is None:
        record = WorkerRecord(id=worker_id, hostname=hostname, started_at=at)
        session.add(record)
    record.models, record.heartbeat_at, record.ready = list(models), at, True
    record.role = role
    session.flush()


def announce_loading(
    session: Session, worker_id: str, hostname: str, models: list[str], at: float
) -> None:
    """Record an engine worker that has started loading its engines at ``at`` (unix seconds):
    not ready, ``started_at`` and ``heartbeat_at`` both ``at`` (``is_loading``). ``register``
    then makes it ready, keeping ``started_at``."""
    record = session.get(WorkerRecord, worker_id)
    if record is None:
        record = WorkerRecord(id=worker_id, hostname=hostname)
        session.add(record)
    record.models, record.role, record.ready = list(models), "engine", False
    record.started_at = record.heartbeat_at = at
    session.flush()


def is_loading(record: WorkerRecord) -> bool:
    """Whether ``record`` is an engine worker still loading its engines: announced, never ready.
    A worker that was ready has a heartbeat later than its start (``register`` refreshes it), so
    a retired one never reads as loading."""
    return not record.ready and record.heartbeat_at == record.started_at


def heartbeat(session: Session, worker_id: str, at: float) -> bool:
    """Mark a ready worker alive at ``at`` (unix seconds). False when no ready record has that
    id (never registered, retired, or pruned): the caller should register again."""
    result = session.execute(
        update(WorkerRecord)
        .where(WorkerRecord.id == worker_id, WorkerRecord.ready.is_(True))
        .values(heartbeat_at=at)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0))


def retire(session: Session, worker_id: str) -> None:
    """Mark a worker stopped (a clean shutdown): it no longer counts as alive, at once. Its
    last heartbeat becomes the goodbye's time (so it never reads as ``is_loading``)."""
    session.execute(
        update(WorkerRecord)
        .where(WorkerRecord.id == worker_id)
        .values(ready=False, heartbeat_at=time.time())
        .execution_options(synchronize_session=False)
    )


def seen_since(session: Session, since: float) -> list[WorkerRecord]:
    """Every worker whose last heartbeat is at or after ``since`` (unix seconds), ready or
    retired, newest heartbeat first: the live ones and the recently gone."""
    return list(
        session.scalars(
            select(WorkerRecord)
            .where(WorkerRecord.heartbeat_at >= since)
            .order_by(WorkerRecord.heartbeat_at.desc(), WorkerRecord.id)
        )
    )


def prune(session: Session, before: float) -> int:
    """Delete the records of workers whose last heartbeat is older than ``before`` (unix
    seconds): each start registers a new record. Returns how many were deleted."""
    result = session.execute(
        delete(WorkerRecord)
        .where(WorkerRecord.heartbeat_at < before)
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)
