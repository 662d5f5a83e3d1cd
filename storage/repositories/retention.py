"""What the retention sweep deletes: expired and deleted files, the request rows of batches that
ended long ago, and expired idempotency keys. Each call deletes at most ``limit`` of its kind,
so one sweep's transaction stays short; the next sweep goes on."""

from __future__ import annotations

from sqlalchemy import delete, exists, or_, select
from sqlalchemy.orm import Session

from offpeak.statuses import BatchStatus
from storage.models import Batch, File, IdempotencyKey, LedgerEntry, RequestLine


def expired_files(session: Session, *, at: int, limit: int) -> list[tuple[str, str]]:
    """``(file id, blob key)`` of files past their ``expires_at`` or already deleted (a delete
    removes the bytes at once and keeps the row), oldest first, locked for the caller's
    transaction (``SKIP LOCKED``: two sweeps split the work)."""
    rows = session.execute(
        select(File.id, File.blob_key)
        .where(or_(File.deleted.is_(True), File.expires_at <= at))
        .order_by(File.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return [(file_id, key) for file_id, key in rows]


def delete_files(session: Session, file_ids: list[str]) -> int:
    if not file_ids:
        return 0
    result = session.execute(
        delete(File).where(File.id.in_(file_ids)).execution_options(synchronize_session=False)
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


def batches_to_prune(session: Session, *, ended_before: int, limit: int) -> list[str]:
    """Ids of batches that ended before ``ended_before`` (unix seconds), are billed (the bill is
    computed from the batch's own counters, so it needs no row) and still have request rows."""
    billed = exists().where(LedgerEntry.batch_id == Batch.id)
    has_rows = exists().where(RequestLine.batch_id == Batch.id)
    return list(
        session.scalars(
            select(Batch.id)
            .where(
                Batch.status.in_(BatchStatus.FINAL),
                Batch.ended_at < ended_before,
                billed,
                has_rows,
            )
            .order_by(Batch.id)
            .limit(limit)
        )
    )


def delete_request_rows(session: Session, batch_id: str, *, limit: int) -> int:
    """Delete up to ``limit`` request rows of one batch; returns how many went."""
    ids = select(RequestLine.id).where(RequestLine.batch_id == batch_id).limit(limit)
    result = session.execute(
        delete(RequestLine)
        .where(RequestLine.id.in_(ids.scalar_subquery()))
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


def purge_idempotency_keys(session: Session, *, at: float) -> int:
    result = session.execute(
        delete(IdempotencyKey)
        .where(IdempotencyKey.expires_at <= at)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]
