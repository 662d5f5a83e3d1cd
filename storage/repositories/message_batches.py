"""Message Batches (Anthropic's surface): the batch rows whose endpoint is ``/v1/messages``,
their pages by ``after_id``/``before_id``, their request lines by outcome, and deletion.

A deleted Message Batch keeps its row (``deleted_at`` set; its bill and its share of engine
time stay, as the ledger and the engine-time attribution of other batches rely on them) and
loses its request lines and files.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from offpeak.endpoints.anthropic_messages import URL
from storage.models import Batch, RequestLine


def _visible(tenant_id: str):  # type: ignore[no-untyped-def]
    return select(Batch).where(
        Batch.tenant_id == tenant_id, Batch.endpoint == URL, Batch.deleted_at.is_(None)
    )


def get(session: Session, tenant_id: str, batch_id: str) -> Batch | None:
    """The tenant's Message Batch ``batch_id``, unless deleted."""
    return session.scalar(_visible(tenant_id).where(Batch.id == batch_id))


def page(
    session: Session,
    tenant_id: str,
    *,
    after_id: str | None,
    before_id: str | None,
    limit: int,
) -> tuple[list[Batch], bool]:
    """Up to ``limit`` Message Batches, newest first, and whether more follow in the direction
    of the cursor: older than ``after_id``, or the ``limit`` newer ones right before
    ``before_id``, or the newest."""
    query = _visible(tenant_id)
    if before_id is not None:
        rows = list(
            session.scalars(
                query.where(Batch.id > before_id).order_by(Batch.id.asc()).limit(limit + 1)
            )
        )
        return list(reversed(rows[:limit])), len(rows) > limit
    if after_id is not None:
        query = query.where(Batch.id < after_id)
    rows = list(session.scalars(query.order_by(Batch.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def line_statuses(session: Session, batch_ids: Iterable[str]) -> dict[str, dict[str, int]]:
    """``batch_id → {line status: request lines}`` (an index-only count per batch)."""
    ids = list(batch_ids)
    if not ids:
        return {}
    rows = session.execute(
        select(RequestLine.batch_id, RequestLine.status, func.count())
        .where(RequestLine.batch_id.in_(ids))
        .group_by(RequestLine.batch_id, RequestLine.status)
    )
    out: dict[str, dict[str, int]] = {batch_id: {} for batch_id in ids}
    for batch_id, status, count in rows:
        out[batch_id][status] = count
    return out


def mark_deleted(session: Session, batch: Batch, at: int) -> int:
    """Delete the batch's request lines and mark it deleted at unix second ``at``; returns
    the lines deleted."""
    result = session.execute(delete(RequestLine).where(RequestLine.batch_id == batch.id))
    batch.deleted_at = at
    session.flush()
    return int(getattr(result, "rowcount", 0) or 0)
