"""Worker registrations: which models each live worker serves."""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.models import WorkerRecord


def register(session: Session, worker_id: str, hostname: str, models: list[str]) -> None:
    """Record (or refresh) a worker whose engines are loaded and ready."""
    at = time.time()
    record = session.get(WorkerRecord, worker_id)
    if record is None:
        record = WorkerRecord(id=worker_id, hostname=hostname, started_at=at)
        session.add(record)
    record.models, record.heartbeat_at, record.ready = list(models), at, True
    session.flush()


def ready_since(session: Session, since: float) -> list[WorkerRecord]:
    """Workers that were ready at or after ``since`` (unix seconds)."""
    return list(
        session.scalars(
            select(WorkerRecord).where(
                WorkerRecord.ready.is_(True), WorkerRecord.heartbeat_at >= since
            )
        )
    )
