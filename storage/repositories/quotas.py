"""What each tenant uses of its quotas, computed from the live rows, and the tenant row lock
that makes checking a quota and taking from it one step.

Nothing keeps a running total: a batch holds ``enqueued_tokens × unfinished lines / lines`` of
its model's enqueued-token quota while it is ``in_progress`` (``unfinished`` from
``request_counts``, which the runner's result writes keep current in the same transactions),
and nothing once it leaves it (completed, failed, expired, cancelling, cancelled), so a finished,
failed, expired or cancelled line gives its share back in the transaction that ends it. A
per-line figure would be exact to the token but cost a scan of every unfinished line per
check; this costs one row per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from offpeak import tenant_limits
from offpeak.statuses import BatchStatus
from storage.db import Executor, is_postgres
from storage.models import Batch, EngineChunk, File, Tenant
from storage.repositories import scheduler as scheduler_repo

#: Statuses that count against ``max_batches_in_progress``.
IN_PROGRESS = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING)
#: Engine chunks of a model read for its last measured rate when the window holds too few.
LAST_CHUNKS = 200


def lock_tenant(session: Session, tenant_id: str) -> Tenant | None:
    """The tenant, fresh from the database and locked until the transaction ends, so two
    transactions checking one of its quotas take turns and the second sees what the first
    committed. PostgreSQL's ``FOR NO KEY UPDATE``: it does not wait for, nor block, the
    ``FOR KEY SHARE`` that inserting a row referencing the tenant takes. SQLite ignores row
    locks: a no-op write takes the database's write lock first."""
    if not is_postgres(session):
        session.execute(
            update(Tenant)
            .where(Tenant.id == tenant_id)
            .values(name=Tenant.name)
            .execution_options(synchronize_session=False)
        )
    query = select(Tenant).where(Tenant.id == tenant_id).with_for_update(key_share=True)
    return session.scalar(query.execution_options(populate_existing=True))


def _held_tokens():  # type: ignore[no-untyped-def]
    unfinished = Batch.total - Batch.completed - Batch.failed
    # Rounded up, so a batch with a line left holds at least a token.
    return (Batch.enqueued_tokens * unfinished + Batch.total - 1) / Batch.total


def enqueued_tokens(db: Executor, tenant_id: str, model: str) -> int:
    """Enqueued tokens the tenant's ``in_progress`` batches of ``model`` hold."""
    query = select(func.coalesce(func.sum(_held_tokens()), 0)).where(
        Batch.tenant_id == tenant_id,
        Batch.model == model,
        Batch.status == BatchStatus.IN_PROGRESS,
        Batch.enqueued_tokens.is_not(None),
        Batch.total > 0,
    )
    return int(db.execute(query).scalar_one())


def engine_tokens_per_second(db: Executor, model: str, since: float) -> float | None:
    """One engine's measured completion tokens per busy second of ``model``: over its engine
    chunks that ended since ``since`` (unix seconds; the scheduler's throughput window), else
    over its last ``LAST_CHUNKS`` chunks whenever they ran, so a quiet night does not forget
    the engine's rate; ``None`` when neither holds ``tenant_limits.MEASURED_AFTER_TOKENS``."""
    history = scheduler_repo.engine_history(db, model, since)  # type: ignore[arg-type]
    rate = tenant_limits.measured_tokens_per_second(history.completion_tokens, history.busy_seconds)
    if rate is not None:
        return rate
    last = (
        select(EngineChunk.completion_tokens, EngineChunk.busy_seconds)
        .where(EngineChunk.model == model)
        .order_by(EngineChunk.started_at.desc())
        .limit(LAST_CHUNKS)
        .subquery()
    )
    tokens, busy = db.execute(
        select(func.coalesce(func.sum(last.c.completion_tokens), 0),
               func.coalesce(func.sum(last.c.busy_seconds), 0.0))
    ).one()  # fmt: skip
    return tenant_limits.measured_tokens_per_second(int(tokens), float(busy))


def batches_in_progress(db: Executor, tenant_id: str) -> int:
    query = select(func.count()).where(Batch.tenant_id == tenant_id, Batch.status.in_(IN_PROGRESS))
    return int(db.execute(query).scalar_one())


def stored_bytes(db: Executor, tenant_id: str) -> int:
    """Bytes of the tenant's files not deleted (uploads, outputs and errors)."""
    query = select(func.coalesce(func.sum(File.bytes), 0)).where(
        File.tenant_id == tenant_id, File.deleted.is_(False)
    )
    return int(db.execute(query).scalar_one())


@dataclass(frozen=True)
class TenantUse:
    """One tenant's use of its quotas: enqueued tokens by model, batches in progress, bytes."""

    enqueued_tokens: dict[str, int]
    batches_in_progress: int
    stored_bytes: int


def use_of(db: Executor, tenant_ids: list[str]) -> dict[str, TenantUse]:
    """``TenantUse`` of each tenant in ``tenant_ids`` (three grouped statements in all)."""
    if not tenant_ids:
        return {}
    tokens: dict[str, dict[str, int]] = {tenant_id: {} for tenant_id in tenant_ids}
    held = db.execute(
        select(Batch.tenant_id, Batch.model, func.sum(_held_tokens()))
        .where(
            Batch.tenant_id.in_(tenant_ids),
            Batch.status == BatchStatus.IN_PROGRESS,
            Batch.enqueued_tokens.is_not(None),
            Batch.total > 0,
        )
        .group_by(Batch.tenant_id, Batch.model)
    )
    for tenant_id, model, amount in held:
        tokens[tenant_id][model] = int(amount or 0)
    batches = dict(
        db.execute(
            select(Batch.tenant_id, func.count())
            .where(Batch.tenant_id.in_(tenant_ids), Batch.status.in_(IN_PROGRESS))
            .group_by(Batch.tenant_id)
        ).all()
    )
    stored = dict(
        db.execute(
            select(File.tenant_id, func.sum(File.bytes))
            .where(File.tenant_id.in_(tenant_ids), File.deleted.is_(False))
            .group_by(File.tenant_id)
        ).all()
    )
    return {
        tenant_id: TenantUse(
            enqueued_tokens=tokens[tenant_id],
            batches_in_progress=int(batches.get(tenant_id, 0)),
            stored_bytes=int(stored.get(tenant_id, 0) or 0),
        )
        for tenant_id in tenant_ids
    }
