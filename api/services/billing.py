"""Money on the API side: each batch's figures (from its bill once billed, a live estimate
before) and ``GET /v1/usage`` (sums of the tenant's bills)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal

from sqlalchemy.orm import Session

from api.errors import BadRequest
from api.schemas.usage import UsageBucket, UsageReport
from offpeak.billing import MONEY_DIGITS, Bill, bill, cost_per_million_tokens, token_weights
from offpeak.settings import Settings
from storage.db import Executor
from storage.models import Batch, LedgerEntry
from storage.repositories import billing as billing_repo
from storage.repositories.billing import UsageRow

#: ``GET /v1/usage`` without ``start`` covers this many seconds before ``end``.
DEFAULT_SPAN_SECONDS = 30 * 86_400
GroupBy = Literal["model", "day", "adapter"]


def _from_entry(entry: LedgerEntry) -> Bill:
    return Bill(
        gpu_seconds=entry.gpu_seconds,
        cost=float(entry.cost),
        price=float(entry.price),
        realtime_price=float(entry.realtime_price),
        tokens=entry.input_tokens + entry.output_tokens,
        billed_at=entry.billed_at,
    )


def _live(
    settings: Settings, model: str | None, tokens: tuple[int, int, int], seconds: dict[str, float]
) -> Bill:
    """A live estimate at today's prices: engine seconds attributed so far and the (input,
    cached, output) tokens so far."""
    return bill(settings, model, seconds, *tokens)


def bills(session: Session, settings: Settings, batches: Sequence[Batch]) -> dict[str, Bill]:
    """``batch_id → Bill`` for these batches in two queries: the ledger's frozen figures for
    billed batches, a live estimate at today's prices for the rest (running, or ended and not
    billed yet)."""
    entries = billing_repo.entries_for(session, [b.id for b in batches])
    live = [b.id for b in batches if b.id not in entries]
    seconds = billing_repo.attributed_seconds(session, live, token_weights(settings))
    return {
        b.id: _from_entry(entries[b.id])
        if b.id in entries
        else _live(
            settings,
            b.model,
            (b.input_tokens, b.cached_tokens, b.output_tokens),
            seconds.get(b.id, {}),
        )
        for b in batches
    }


def bills_of_rows(
    db: Executor, settings: Settings, rows: Sequence[Mapping[str, Any]]
) -> dict[str, Bill]:
    """``bills`` for batches' column values (``Row._asdict()``) read with their bill's
    (``ledger.with_bills``): no query when every one is billed, one (the engine time attributed
    so far) for the others."""
    live = [row["id"] for row in rows if row["billed_at"] is None]
    seconds = billing_repo.attributed_seconds(db, live, token_weights(settings))
    out: dict[str, Bill] = {}
    for row in rows:
        out[row["id"]] = (
            _live(
                settings,
                row["model"],
                (row["input_tokens"], row["cached_tokens"], row["output_tokens"]),
                seconds.get(row["id"], {}),
            )
            if row["billed_at"] is None
            else Bill(
                gpu_seconds=row["bill_gpu_seconds"],
                cost=float(row["bill_cost"]),
                price=float(row["bill_price"]),
                realtime_price=float(row["bill_realtime_price"]),
                tokens=row["bill_tokens"],
                billed_at=row["billed_at"],
            )
        )
    return out


def bill_of(session: Session, settings: Settings, batch: Batch) -> Bill:
    return bills(session, settings, [batch])[batch.id]


def _bucket(row: UsageRow) -> UsageBucket:
    day = datetime.fromtimestamp(row.day, UTC).date().isoformat() if row.day is not None else None
    cost, price, listed = float(row.cost), float(row.price), float(row.realtime_price)
    return UsageBucket(
        model=row.model,
        adapter=row.adapter,
        day=day,
        start_time=row.day,
        batches=row.batches,
        requests=row.requests,
        input_tokens=row.input_tokens,
        cached_tokens=row.cached_tokens,
        output_tokens=row.output_tokens,
        total_tokens=row.input_tokens + row.output_tokens,
        gpu_seconds=round(row.gpu_seconds, 6),
        cost=cost,
        price=price,
        realtime_price=listed,
        saving=round(listed - price, MONEY_DIGITS),
        cost_per_million_tokens=cost_per_million_tokens(cost, row.input_tokens + row.output_tokens),
    )


def report(
    session: Session,
    tenant_id: str,
    *,
    start: int | None,
    end: int | None,
    group_by: GroupBy | None,
) -> UsageReport:
    """The tenant's billed usage for batches that ended in ``[start, end)`` (unix seconds;
    default: the 30 days up to now), grouped by model, by UTC day, by model and LoRA adapter
    (``adapter``), or not at all, with a total.

    Raises ``BadRequest`` when ``start`` is not before ``end``.
    """
    end = int(time.time()) + 1 if end is None else end
    start = end - DEFAULT_SPAN_SECONDS if start is None else start
    if start >= end:
        raise BadRequest("start must be before end (unix seconds).", param="start")
    if group_by == "adapter":
        rows = billing_repo.adapter_usage(session, tenant_id, start, end)
    else:
        rows = billing_repo.usage(session, tenant_id, start, end, group_by)
    totals = billing_repo.usage(session, tenant_id, start, end, None)
    nothing = UsageRow(None, None, 0, 0, 0, 0, 0, 0.0, Decimal(0), Decimal(0), Decimal(0))
    total = _bucket(totals[0] if totals else nothing)
    return UsageReport(
        start=start, end=end, group_by=group_by, data=[_bucket(r) for r in rows], total=total
    )
