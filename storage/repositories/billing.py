"""The ledger and the engine-time attribution it is built from, and the usage queries on it.

Attribution rule: an engine chunk's busy seconds go to the batches whose requests finished in it,
in proportion to their weighted tokens

    weight(batch) = prefill × (prompt − cached) + cached_w × cached + decode × completion

using the chunk's per-batch token counts (``engine_chunk_batches``) over the chunk's totals
(``engine_chunks``, which ``chunks.record`` writes as the sum of its batches' rows). A chunk whose
tokens all weigh 0 is split by finished requests instead. Summed over a chunk's batches the shares
are exactly its busy seconds (up to float rounding). The weights are settings because a prefill
token (many in one forward pass) costs less engine time than a decode token (one pass each).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from typing import Any, Literal

from sqlalchemy import (
    ColumnElement,
    Float,
    Select,
    bindparam,
    case,
    cast,
    delete,
    exists,
    func,
    literal,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from offpeak.billing import TokenWeights
from offpeak.statuses import BatchStatus, LineStatus
from storage.db import Executor
from storage.models import (
    Batch,
    EngineChunk,
    EngineChunkBatch,
    LedgerAdapterUsage,
    LedgerEntry,
    RequestLine,
)

DAY_SECONDS = 86_400
#: Histogram bounds of time-to-complete as a share of the completion window (1.0 = at the deadline).
WINDOW_SHARE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def batch_key(batch_id: str) -> str:
    """The ledger key of a batch's bill: one bill per batch, ever."""
    return f"batch:{batch_id}"


def _weighted(prompt: Any, cached: Any, completion: Any, w: TokenWeights) -> ColumnElement[float]:
    return (
        (prompt - cached) * literal(w.prefill, Float)
        + cached * literal(w.cached, Float)
        + completion * literal(w.decode, Float)
    )


def _share(w: TokenWeights) -> ColumnElement[float]:
    """The fraction of a chunk's seconds that goes to one of its batch rows."""
    part = _weighted(
        EngineChunkBatch.prompt_tokens,
        EngineChunkBatch.cached_tokens,
        EngineChunkBatch.completion_tokens,
        w,
    )
    whole = _weighted(
        EngineChunk.prompt_tokens, EngineChunk.cached_tokens, EngineChunk.completion_tokens, w
    )
    by_requests = cast(EngineChunkBatch.requests, Float) / func.nullif(EngineChunk.requests, 0)
    return case((whole > 0, part / whole), else_=by_requests)


@lru_cache(maxsize=8)
def _attributed(weights: TokenWeights) -> Select[str, str, float]:
    """``attributed_seconds``' statement, built once per weights (a status poll of a running
    batch runs it: building it cost more than running it); ``ids`` an expanding parameter."""
    return (
        select(
            EngineChunkBatch.batch_id,
            EngineChunk.device,
            func.sum(EngineChunk.busy_seconds * _share(weights)),
        )
        .join(EngineChunk, EngineChunk.id == EngineChunkBatch.chunk_id)
        .where(EngineChunkBatch.batch_id.in_(bindparam("ids", expanding=True)))
        .group_by(EngineChunkBatch.batch_id, EngineChunk.device)
    )


def attributed_seconds(
    db: Executor, batch_ids: Iterable[str], weights: TokenWeights
) -> dict[str, dict[str, float]]:
    """``batch_id → {worker pool (device) → engine seconds}`` attributed so far, by the rule in
    this module's docstring. Batches with no finished request in any chunk are absent."""
    ids = list(set(batch_ids))
    if not ids:
        return {}
    rows = db.execute(_attributed(weights), {"ids": ids})
    out: dict[str, dict[str, float]] = {}
    for batch_id, device, seconds in rows:
        out.setdefault(batch_id, {})[device] = float(seconds or 0.0)
    return out


def chunk_shares(session: Session, chunk_id: int, weights: TokenWeights) -> dict[str, float]:
    """``batch_id → seconds`` of one chunk (they add up to its ``busy_seconds``)."""
    rows = session.execute(
        select(EngineChunkBatch.batch_id, EngineChunk.busy_seconds * _share(weights))
        .join(EngineChunk, EngineChunk.id == EngineChunkBatch.chunk_id)
        .where(EngineChunkBatch.chunk_id == chunk_id)
    )
    return {batch_id: float(seconds) for batch_id, seconds in rows}


def insert_once(session: Session, values: dict[str, Any]) -> bool:
    """Insert a ledger entry unless one with the same ``key`` exists (``ON CONFLICT DO NOTHING``,
    so concurrent billers cannot both insert). Returns True if this call inserted it."""
    dialect = session.get_bind().dialect.name
    module = postgresql if dialect == "postgresql" else sqlite
    statement = (
        module.insert(LedgerEntry)
        .values(**values)
        .on_conflict_do_nothing()
        .returning(LedgerEntry.id)
    )
    return session.execute(statement).first() is not None


#: A bill's figures beside its batch's columns (``with_bills``), named apart from them:
#: engine seconds, the three amounts, the billed tokens (input + output) and ``billed_at``.
BILL_COLUMNS = (
    LedgerEntry.gpu_seconds.label("bill_gpu_seconds"),
    LedgerEntry.cost.label("bill_cost"),
    LedgerEntry.price.label("bill_price"),
    LedgerEntry.realtime_price.label("bill_realtime_price"),
    (LedgerEntry.input_tokens + LedgerEntry.output_tokens).label("bill_tokens"),
    LedgerEntry.billed_at.label("billed_at"),
)


def with_bills(query: Select[Any]) -> Select[Any]:
    """``query`` (a select of ``batches`` columns) with each batch's bill's figures
    (``BILL_COLUMNS``), NULL until it is billed: one statement where a batch and then its bill
    were two round trips. The join is on the ledger's unique ``key`` (``batch_key`` in SQL:
    ``'batch:' || batches.id``)."""
    key = literal("batch:") + Batch.id
    return query.add_columns(*BILL_COLUMNS).outerjoin(LedgerEntry, LedgerEntry.key == key)


def entries_for(session: Session, batch_ids: Iterable[str]) -> dict[str, LedgerEntry]:
    """The bills of these batches, by batch id (batches not billed yet are absent)."""
    keys = [batch_key(b) for b in set(batch_ids)]
    if not keys:
        return {}
    rows = session.scalars(select(LedgerEntry).where(LedgerEntry.key.in_(keys)))
    return {entry.batch_id: entry for entry in rows}


def unbilled_ended(session: Session, created_since: int, limit: int = 500) -> list[str]:
    """Ended batches created at or after ``created_since`` (unix seconds) that have no bill:
    their billing step failed or never ran. Oldest first."""
    billed = exists().where(LedgerEntry.batch_id == Batch.id)
    return list(
        session.scalars(
            select(Batch.id)
            .where(Batch.status.in_(BatchStatus.FINAL), Batch.created_at >= created_since, ~billed)
            .order_by(Batch.id)
            .limit(limit)
        )
    )


@dataclass(frozen=True)
class UsageRow:
    """Billed usage of one group (a model, a UTC day, or everything)."""

    model: str | None
    day: int | None  # unix second at 00:00 UTC
    batches: int
    requests: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    gpu_seconds: float
    cost: Decimal
    price: Decimal
    realtime_price: Decimal
    #: The LoRA adapter (grouped by adapter; ``None``: the base model's own lines).
    adapter: str | None = None


def adapter_tokens(session: Session, batch_id: str) -> list[tuple[str, int, int, int, int]]:
    """``(adapter, requests, prompt, cached, completion tokens)`` of a batch's succeeded lines
    per adapter they named (``""``: the base model), the adapter's usage that its bill splits."""
    adapter = func.coalesce(RequestLine.adapter, "")
    rows = session.execute(
        select(
            adapter,
            func.count(),
            func.coalesce(func.sum(RequestLine.prompt_tokens), 0),
            func.coalesce(func.sum(RequestLine.cached_tokens), 0),
            func.coalesce(func.sum(RequestLine.completion_tokens), 0),
        )
        .where(RequestLine.batch_id == batch_id, RequestLine.status == LineStatus.SUCCEEDED)
        .group_by(adapter)
        .order_by(adapter)
    )
    return [(str(a), int(n), int(p), int(c), int(o)) for a, n, p, c, o in rows]


def insert_adapter_usage(session: Session, rows: list[dict[str, Any]]) -> None:
    """Write a bill's split by adapter (``LedgerAdapterUsage`` rows), in the transaction that
    inserted the bill; a split left by an earlier bill of the key (its entry since deleted) is
    replaced."""
    if rows:
        keys = {row["key"] for row in rows}
        session.execute(delete(LedgerAdapterUsage).where(LedgerAdapterUsage.key.in_(keys)))
        session.execute(LedgerAdapterUsage.__table__.insert(), rows)


def adapter_usage(session: Session, tenant_id: str, start: int, end: int) -> list[UsageRow]:
    """The tenant's billed usage for batches that ended in ``[start, end)``, one row per model
    and LoRA adapter (``adapter`` ``None``: the model's own lines)."""
    u = LedgerAdapterUsage
    query = (
        select(
            u.model,
            u.adapter,
            func.count(func.distinct(u.batch_id)),
            func.sum(u.requests),
            func.sum(u.input_tokens),
            func.sum(u.cached_tokens),
            func.sum(u.output_tokens),
            func.sum(u.gpu_seconds),
            func.sum(u.cost),
            func.sum(u.price),
            func.sum(u.realtime_price),
        )
        .where(u.tenant_id == tenant_id, u.ended_at >= start, u.ended_at < end)
        .group_by(u.model, u.adapter)
        .order_by(u.model, u.adapter)
    )
    return [
        UsageRow(
            model=model,
            day=None,
            batches=int(batches),
            requests=int(requests),
            input_tokens=int(input_tokens),
            cached_tokens=int(cached),
            output_tokens=int(output),
            gpu_seconds=float(seconds),
            cost=Decimal(cost),
            price=Decimal(price),
            realtime_price=Decimal(listed),
            adapter=adapter or None,
        )
        for (model, adapter, batches, requests, input_tokens, cached, output, seconds, cost,
             price, listed) in session.execute(query)
    ]  # fmt: skip


def usage(
    session: Session,
    tenant_id: str,
    start: int,
    end: int,
    group_by: Literal["model", "day"] | None,
) -> list[UsageRow]:
    """Sums of the tenant's bills for batches that ended in ``[start, end)`` (unix seconds),
    one row per model, per UTC day, or a single row (none if nothing was billed)."""
    day = (LedgerEntry.ended_at // DAY_SECONDS) * DAY_SECONDS
    keys: list[Any] = [LedgerEntry.model] if group_by == "model" else [day] if group_by else []
    query = select(
        *keys,
        func.count(),
        func.coalesce(func.sum(LedgerEntry.requests), 0),
        func.coalesce(func.sum(LedgerEntry.input_tokens), 0),
        func.coalesce(func.sum(LedgerEntry.cached_tokens), 0),
        func.coalesce(func.sum(LedgerEntry.output_tokens), 0),
        func.coalesce(func.sum(LedgerEntry.gpu_seconds), 0.0),
        func.coalesce(func.sum(LedgerEntry.cost), 0),
        func.coalesce(func.sum(LedgerEntry.price), 0),
        func.coalesce(func.sum(LedgerEntry.realtime_price), 0),
    ).where(
        LedgerEntry.tenant_id == tenant_id,
        LedgerEntry.ended_at >= start,
        LedgerEntry.ended_at < end,
    )
    if keys:
        query = query.group_by(*keys).order_by(*keys)
    out = []
    for row in session.execute(query):
        values: Sequence[Any] = tuple(row)
        model = values[0] if group_by == "model" else None
        bucket = int(values[0]) if group_by == "day" else None
        (
            batches,
            requests,
            input_tokens,
            cached_tokens,
            output_tokens,
            seconds,
            cost,
            price,
            listed,
        ) = values[len(keys) :]
        if not batches:
            continue
        out.append(
            UsageRow(
                model=model,
                day=bucket,
                batches=int(batches),
                requests=int(requests),
                input_tokens=int(input_tokens),
                cached_tokens=int(cached_tokens),
                output_tokens=int(output_tokens),
                gpu_seconds=float(seconds),
                cost=Decimal(cost),
                price=Decimal(price),
                realtime_price=Decimal(listed),
            )
        )
    return out


def totals_by_model(session: Session) -> list[tuple[str | None, int, float, Decimal, Decimal]]:
    """``(model, tokens, gpu_seconds, cost, price)`` over the whole ledger, per model."""
    rows = session.execute(
        select(
            LedgerEntry.model,
            func.sum(LedgerEntry.input_tokens + LedgerEntry.output_tokens),
            func.sum(LedgerEntry.gpu_seconds),
            func.sum(LedgerEntry.cost),
            func.sum(LedgerEntry.price),
        ).group_by(LedgerEntry.model)
    )
    return [
        (model, int(tokens or 0), float(seconds or 0), Decimal(cost or 0), Decimal(price or 0))
        for model, tokens, seconds, cost, price in rows
    ]


def _window_share() -> ColumnElement[Any]:
    return cast(LedgerEntry.ended_at - LedgerEntry.created_at, Float) / LedgerEntry.window_seconds


def completion_share_buckets(
    session: Session, bounds: Sequence[float]
) -> tuple[list[int], int, float]:
    """For completed batches in the whole ledger: cumulative counts of time-to-complete as a share
    of the window at or below each bound, the count, and the sum of the shares."""
    share = _window_share()
    completed = (LedgerEntry.status == BatchStatus.COMPLETED) & (LedgerEntry.window_seconds > 0)
    row = session.execute(
        select(
            *[func.count().filter(share <= bound) for bound in bounds],
            func.count(),
            func.coalesce(func.sum(share), 0.0),
        ).where(completed)
    ).one()
    values = tuple(row)
    return [int(v) for v in values[: len(bounds)]], int(values[-2]), float(values[-1])


def completion_shares_since(session: Session, ended_since: int) -> list[float]:
    """Time to complete as a share of the window, for batches completed since ``ended_since``."""
    return [
        float(v)
        for v in session.scalars(
            select(_window_share()).where(
                LedgerEntry.status == BatchStatus.COMPLETED,
                LedgerEntry.window_seconds > 0,
                LedgerEntry.ended_at >= ended_since,
            )
        )
    ]
