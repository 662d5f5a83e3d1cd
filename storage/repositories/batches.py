"""Batches: lookups, status changes and the counters behind ``request_counts`` and ``usage``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from storage.models import Batch, RequestLine

#: Statuses after which nothing changes.
FINAL_STATUSES = ("completed", "failed", "expired", "cancelled")


def add(session: Session, batch: Batch) -> Batch:
    session.add(batch)
    session.flush()
    return batch


def get(session: Session, tenant_id: str, batch_id: str) -> Batch | None:
    return session.scalar(select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id))


def get_for_update(session: Session, batch_id: str, skip_locked: bool = False) -> Batch | None:
    """The batch, row-locked until the transaction ends (tasks serialize on it). With
    ``skip_locked``, ``None`` when another transaction holds the lock."""
    query = select(Batch).where(Batch.id == batch_id)
    return session.scalar(query.with_for_update(skip_locked=skip_locked))


def get_any(session: Session, batch_id: str) -> Batch | None:
    return session.get(Batch, batch_id)


def page(session: Session, tenant_id: str, *, after: str | None, limit: int) -> Sequence[Batch]:
    """Up to ``limit + 1`` batches, newest first, older than the cursor ``after``."""
    query = select(Batch).where(Batch.tenant_id == tenant_id)
    if after:
        query = query.where(Batch.id < after)
    return session.scalars(query.order_by(Batch.id.desc()).limit(limit + 1)).all()


def statuses(session: Session, batch_ids: Iterable[str]) -> dict[str, tuple[str, int]]:
    """``batch_id → (status, expires_at)`` for the given batches."""
    ids = list(batch_ids)
    if not ids:
        return {}
    rows = session.execute(
        select(Batch.id, Batch.status, Batch.expires_at).where(Batch.id.in_(ids))
    )
    return {batch_id: (status, expires_at) for batch_id, status, expires_at in rows}


def refresh_counts(session: Session, batch_ids: Iterable[str]) -> None:
    """Recompute ``request_counts`` and ``usage`` from the request rows, so the numbers a
    client polls always match the rows (and so the files written from them)."""
    for batch_id in set(batch_ids):
        done = RequestLine.status.in_(("succeeded", "failed", "cancelled", "expired"))
        row = session.execute(
            select(
                func.count(),
                func.count().filter(RequestLine.status == "succeeded"),
                func.count().filter(done, RequestLine.status != "succeeded"),
                func.coalesce(func.sum(RequestLine.prompt_tokens), 0),
                func.coalesce(func.sum(RequestLine.cached_tokens), 0),
                func.coalesce(func.sum(RequestLine.completion_tokens), 0),
            ).where(RequestLine.batch_id == batch_id)
        ).one()
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(
                total=row[0],
                completed=row[1],
                failed=row[2],
                input_tokens=row[3],
                cached_tokens=row[4],
                output_tokens=row[5],
            )
        )


def unfinished_by_status(session: Session, batch_id: str) -> dict[str, int]:
    """Counts of this batch's request rows still ``pending`` or ``running``."""
    rows = session.execute(
        select(RequestLine.status, func.count())
        .where(RequestLine.batch_id == batch_id, RequestLine.status.in_(("pending", "running")))
        .group_by(RequestLine.status)
    )
    return {status: count for status, count in rows}


def active_models(session: Session) -> list[str]:
    """Models with batches still running, for re-enqueueing work after a restart."""
    rows = session.scalars(
        select(Batch.model)
        .where(Batch.status.in_(("in_progress", "cancelling")), Batch.model.is_not(None))
        .distinct()
    )
    return [m for m in rows if m]


def finished_but_running(session: Session) -> list[str]:
    """``in_progress`` batches with no line left to run: their finalize message was lost."""
    open_lines = select(RequestLine.id).where(
        RequestLine.batch_id == Batch.id, RequestLine.status.in_(("pending", "running"))
    )
    query = select(Batch.id).where(Batch.status == "in_progress", ~open_lines.exists())
    return list(session.scalars(query))


def ids_in_status(session: Session, status: str) -> list[str]:
    return list(session.scalars(select(Batch.id).where(Batch.status == status)))


def expired_ids(session: Session, at: int) -> list[str]:
    """Batches still running whose window ended at or before ``at`` (unix seconds)."""
    return list(
        session.scalars(
            select(Batch.id).where(
                Batch.status.in_(("validating", "in_progress")), Batch.expires_at <= at
            )
        )
    )
