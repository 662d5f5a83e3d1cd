"""The rows behind the per-tenant views (``api.services.tenant_views``): every running batch's
queued lines with its tenant's weight and deadline figures, what the engines served each
tenant over a recent window, and the tenants' weights.

A batch's queued lines come from its ``request_counts`` (lines not finished: pending or
running), one row per batch, the figure the fair share itself counts
(``storage.repositories.shared_claims.WaitingBatch.left``), so a view costs no scan of lines.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import func, select

from offpeak.statuses import BatchStatus
from storage.db import Executor
from storage.models import Batch, EngineChunk, EngineChunkBatch, Tenant


@dataclass(frozen=True)
class QueuedBatch:
    """An ``in_progress`` batch: its tenant and the tenant's weight, its model, lines not
    finished, deadline (unix seconds), completion window and the scheduler's estimate of its
    last line's finish (``None`` before the first estimate)."""

    batch_id: str
    tenant_id: str
    weight: float
    model: str
    left: int
    expires_at: int
    window_seconds: int
    estimated_completion_at: float | None


def queued_batches(db: Executor) -> list[QueuedBatch]:
    """Every ``in_progress`` batch with lines not finished (``QueuedBatch``), by id."""
    rows = db.execute(
        select(
            Batch.id,
            Batch.tenant_id,
            func.coalesce(Tenant.weight, 1.0),
            Batch.model,
            Batch.total - Batch.completed - Batch.failed,
            Batch.expires_at,
            Batch.window_seconds,
            Batch.estimated_completion_at,
        )
        .join(Tenant, Tenant.id == Batch.tenant_id)
        .where(
            Batch.status == BatchStatus.IN_PROGRESS,
            Batch.model.is_not(None),
            Batch.total - Batch.completed - Batch.failed > 0,
        )
        .order_by(Batch.id)
    )
    return [QueuedBatch(*row) for row in rows]


@dataclass(frozen=True)
class Served:
    """What the engines served one tenant since a time: lines finished and engine-seconds (each
    engine chunk's busy seconds split between its batches by their lines in it)."""

    tenant_id: str
    lines: int
    engine_seconds: float


def served_since(db: Executor, since: float) -> list[Served]:
    """``Served`` of every tenant with lines finished in engine chunks that started at or
    after ``since`` (unix seconds), by tenant id."""
    share = (
        EngineChunk.busy_seconds * EngineChunkBatch.requests / func.nullif(EngineChunk.requests, 0)
    )
    rows = db.execute(
        select(
            Batch.tenant_id,
            func.sum(EngineChunkBatch.requests),
            func.coalesce(func.sum(share), 0.0),
        )
        .select_from(EngineChunk)
        .join(EngineChunkBatch, EngineChunkBatch.chunk_id == EngineChunk.id)
        .join(Batch, Batch.id == EngineChunkBatch.batch_id)
        .where(EngineChunk.started_at >= since)
        .group_by(Batch.tenant_id)
        .order_by(Batch.tenant_id)
    )
    return [
        Served(tenant, int(lines or 0), float(seconds or 0.0)) for tenant, lines, seconds in rows
    ]


def weights(db: Executor, tenant_ids: Collection[str]) -> dict[str, float]:
    """The weight of each tenant of ``tenant_ids`` (1 where unset)."""
    if not tenant_ids:
        return {}
    rows = db.execute(
        select(Tenant.id, func.coalesce(Tenant.weight, 1.0)).where(Tenant.id.in_(tenant_ids))
    )
    return {tenant_id: float(weight) for tenant_id, weight in rows}
