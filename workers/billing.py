"""Billing: once a batch has ended, write its bill to the ledger, exactly once.

A bill prices the batch's finished lines only (expired and cancelled batches included): the
tokens are the batch's ``usage``, which counts succeeded lines; the engine seconds are the chunk
seconds attributed to it (``storage.repositories.billing``); prices come from ``offpeak.billing``
and are frozen in the entry. The entry's key is ``batch:<id>`` and unique, so finalize run twice,
a retried task and the sweep racing each other insert one row between them. ``finalize`` bills
right after the batch's final status commits; ``bill_unbilled`` (every sweep) bills any ended
batch whose billing step failed or never ran (a batch that failed validation never finalizes).
"""

from __future__ import annotations

import logging
import time
from decimal import Decimal

from sqlalchemy.orm import Session

from offpeak.billing import MONEY_DIGITS, Bill, bill, token_weights
from offpeak.settings import Settings
from offpeak.statuses import BatchStatus
from storage.db import session_scope
from storage.models import Batch
from storage.repositories import batches as batches_repo
from storage.repositories import billing as billing_repo
from workers import worker_metrics as metrics

log = logging.getLogger(__name__)

#: How far back (by creation time) the sweep looks for unbilled batches: longer than any window
#: an operator would allow plus the time a broken billing step takes to be noticed and fixed.
LOOKBACK_SECONDS = 35 * 86_400


def ledger_ended_at(batch: Batch) -> int:
    """The ledger's ``ended_at`` (never null) of a final batch: ``Batch.ended_at``, or for a
    final row without its status's stamp, when it began finalizing or else was created."""
    ended = batch.ended_at
    if ended is not None:
        return ended
    return batch.finalizing_at or batch.created_at


def _money(amount: float) -> Decimal:
    return Decimal(str(round(amount, MONEY_DIGITS)))


def bill_batch(settings: Settings, batch_id: str) -> bool:
    """Bill an ended batch unless the ledger already has its bill.

    Returns True if this call wrote the entry, False if the batch is unknown, has not ended, or
    was billed before. Database errors propagate (``bill_safely`` logs them instead).
    """
    with session_scope(settings.resolved_database_url) as session:
        batch = batches_repo.get_any(session, batch_id)
        if batch is None or batch.status not in BatchStatus.FINAL:
            return False
        if billing_repo.entries_for(session, [batch_id]):
            return False
        weights = token_weights(settings)
        seconds = billing_repo.attributed_seconds(session, [batch_id], weights).get(batch_id, {})
        billed_at, ended = time.time(), ledger_ended_at(batch)
        figures = bill(
            settings,
            batch.model,
            seconds,
            batch.input_tokens,
            batch.cached_tokens,
            batch.output_tokens,
            billed_at=billed_at,
        )
        inserted = billing_repo.insert_once(
            session,
            {
                "key": billing_repo.batch_key(batch.id),
                "tenant_id": batch.tenant_id,
                "batch_id": batch.id,
                "model": batch.model,
                "status": batch.status,
                "created_at": batch.created_at,
                "ended_at": ended,
                "window_seconds": batch.window_seconds,
                "billed_at": billed_at,
                "requests": batch.completed,
                "input_tokens": batch.input_tokens,
                "cached_tokens": batch.cached_tokens,
                "output_tokens": batch.output_tokens,
                "gpu_seconds": figures.gpu_seconds,
                "cost": _money(figures.cost),
                "price": _money(figures.price),
                "realtime_price": _money(figures.realtime_price),
            },
        )
        if inserted:
            billing_repo.insert_adapter_usage(
                session, _adapter_split(session, settings, batch, seconds, figures, ended)
            )
        window = batch.window_seconds
        share = (ended - batch.created_at) / window if window else None
        status = batch.status
    if inserted:
        metrics.observe_billed(status, share if status == BatchStatus.COMPLETED else None)
        log.info(
            "billed %s (%s): %.3f GPU-s, cost $%.6f, price $%.6f (real-time $%.6f)",
            batch_id,
            status,
            figures.gpu_seconds,
            figures.cost,
            figures.price,
            figures.realtime_price,
        )
    return inserted


def _adapter_split(
    session: Session,
    settings: Settings,
    batch: Batch,
    seconds: dict[str, float],
    figures: Bill,
    ended: int,
) -> list[dict[str, object]]:
    """The bill's split by LoRA adapter (``LedgerAdapterUsage`` rows): each adapter's lines'
    tokens priced at the base model's prices; its engine seconds, and their cost, are the
    batch's shared by total tokens (the lines of one batch run side by side in the same chunks).
    """
    rows = billing_repo.adapter_tokens(session, batch.id)
    total = sum(prompt + completion for _a, _n, prompt, _c, completion in rows)
    split = []
    for adapter, requests, prompt, cached, completion in rows:
        share = (prompt + completion) / total if total else 1 / len(rows)
        part = bill(settings, batch.model, {k: v * share for k, v in seconds.items()},
                    prompt, cached, completion)  # fmt: skip
        split.append(
            {
                "key": billing_repo.batch_key(batch.id),
                "tenant_id": batch.tenant_id,
                "batch_id": batch.id,
                "model": batch.model,
                "adapter": adapter,
                "ended_at": ended,
                "requests": requests,
                "input_tokens": prompt,
                "cached_tokens": cached,
                "output_tokens": completion,
                "gpu_seconds": figures.gpu_seconds * share,
                "cost": _money(part.cost),
                "price": _money(part.price),
                "realtime_price": _money(part.realtime_price),
            }
        )
    return split


def bill_safely(settings: Settings, batch_id: str) -> bool:
    """``bill_batch`` for callers that must not fail with it (finalize): an error is logged and
    counted, and the sweep bills the batch later."""
    try:
        return bill_batch(settings, batch_id)
    except Exception:
        metrics.observe_billing_failure()
        log.exception("billing %s failed; the sweep will retry", batch_id)
        return False


def bill_unbilled(settings: Settings, limit: int = 500) -> int:
    """Bill ended batches that have no ledger entry yet (run by every sweep). Returns the number
    billed; a batch that fails again is logged and left for the next sweep."""
    since = int(time.time()) - LOOKBACK_SECONDS
    with session_scope(settings.resolved_database_url) as session:
        pending = billing_repo.unbilled_ended(session, since, limit)
    return sum(bill_safely(settings, batch_id) for batch_id in pending)
