"""A running batch's estimated completion time (``estimated_completion_at``, an Offpeak extension
field of the Batch object) from the queue ahead of it in claim order and the engine's measured
rate, and the warning when that estimate falls past the batch's ``expires_at``.

    estimated_completion_at = now + (lines ahead of the batch + its own lines left)
                                    / (measured lines per second of one engine × live engines)

- Lines ahead, in claim order (``workers.scheduler.fair_share``): the lines of other tenants'
  urgent batches first (of an urgent batch, those due no later); then the fair share. Between
  a tenant's batches a claim is split evenly, so while batch B runs its ``q_B`` lines another
  batch C of the same tenant runs ``min(q_C, q_B)``; between tenants it is split by weight, so
  while the tenant runs its ``q_T`` lines (B's and what its other batches get meanwhile) a
  tenant U of weight ``w_U`` runs ``min(q_U, ⌈q_T × w_U / w_T⌉)``. The same approximation as
  ``GET /v1/queue`` (``api.services.tenant_views``), per batch rather than per tenant.
- The rate: lines finished per busy second of the model's engine chunks over the scheduler's
  ``throughput_window_seconds`` (what billing's busy seconds measure), once at least
  ``MEASURED_AFTER_LINES`` lines finished in it, times the live engine workers of the model
  (at least one).
- Without a measured rate the scheduler's own estimate (``workers.scheduler.slack``, stored on
  the batch) is shown; without either, ``None``. A paused batch claims nothing: ``None``.

The queue and the rates are read at most once per ``CACHE_SECONDS`` per process; the batch's
own lines left come from the row the poll reads anyway, so a poll costs no extra statement
between refreshes.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from api.services.tenant_views import MIN_WEIGHT, is_urgent
from offpeak.settings import Settings
from offpeak.statuses import BatchStatus
from storage.db import Executor
from storage.repositories import scheduler as scheduler_repo
from storage.repositories import tenant_views as views_repo
from storage.repositories.tenant_views import QueuedBatch

#: Lines a model's engines must have finished in the window before their rate is trusted.
MEASURED_AFTER_LINES = 5
#: Seconds a process reuses the queue and the rates it read.
CACHE_SECONDS = 5.0
#: The warning's code (``completion_warning.code``).
WARNING_CODE = "may_miss_completion_window"


def lines_ahead(batch: QueuedBatch, queued: Iterable[QueuedBatch], urgent: set[str]) -> int:
    """Lines of other batches of ``batch``'s model claimed before ``batch``'s last line, by the
    claim order's rule above (``queued``: the model's running batches; ``batch`` among them or
    not; ``urgent``: ids of urgent batches). A batch with no line left has none ahead."""
    mine = batch.left
    if mine <= 0:
        return 0
    others = [b for b in queued if b.batch_id != batch.batch_id and b.model == batch.model]
    urgent_others = [b for b in others if b.batch_id in urgent and b.left > 0]
    if batch.batch_id in urgent:
        return sum(b.left for b in urgent_others if b.expires_at <= batch.expires_at)
    ahead = sum(b.left for b in urgent_others)
    shared = [b for b in others if b.batch_id not in urgent and b.left > 0]
    own = sum(min(b.left, mine) for b in shared if b.tenant_id == batch.tenant_id)
    through = mine + own
    weight = {b.tenant_id: max(MIN_WEIGHT, b.weight) for b in shared}
    weight[batch.tenant_id] = max(MIN_WEIGHT, batch.weight)
    theirs: dict[str, int] = {}
    for b in shared:
        if b.tenant_id != batch.tenant_id:
            theirs[b.tenant_id] = theirs.get(b.tenant_id, 0) + b.left
    for tenant, left in theirs.items():
        served = math.ceil(through * weight[tenant] / weight[batch.tenant_id] - 1e-9)
        ahead += min(left, served)
    return ahead + own


def lines_per_second(history: scheduler_repo.EngineHistory, workers: int) -> float | None:
    """The model's measured lines per second: lines finished per busy second of its engine
    chunks (``history``) times ``workers`` (at least 1); ``None`` before
    ``MEASURED_AFTER_LINES`` lines or any busy second."""
    if history.requests < MEASURED_AFTER_LINES or history.busy_seconds <= 0:
        return None
    return history.requests / history.busy_seconds * max(1, workers)


def completion_at(at: float, ahead: int, own: int, rate: float | None) -> float | None:
    """``at + (ahead + own) / rate`` in unix seconds; ``at`` when nothing is left; ``None``
    when ``rate`` (lines per second) is unknown or not positive."""
    if own <= 0:
        return at
    if rate is None or rate <= 0:
        return None
    return at + (max(0, ahead) + own) / rate


def warning(expires_at: float, eta: float | None) -> dict[str, Any] | None:
    """The ``completion_warning`` extension: ``{"code", "message", "estimated_completion_at",
    "expires_at"}`` when ``eta`` is past ``expires_at``, else ``None``. A warning, not an error:
    the estimate may be wrong, and the batch runs on."""
    if eta is None or eta <= expires_at:
        return None
    late = eta - expires_at
    return {
        "code": WARNING_CODE,
        "message": (
            "At the measured rate and with the lines queued ahead of it, this batch is "
            f"estimated to finish about {_duration(late)} after its completion window ends; "
            "it keeps running, and lines not finished by then expire."
        ),
        "estimated_completion_at": int(eta),
        "expires_at": int(expires_at),
    }


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{int(seconds)} s"
    if seconds < 7200:
        return f"{int(seconds // 60)} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class _Snapshot:
    at: float
    queued: Sequence[QueuedBatch]
    urgent: frozenset[str]
    rates: dict[str, float | None]


class _Cache:
    """The latest queue and per-model rates read by this process (``CACHE_SECONDS``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot: _Snapshot | None = None

    def get(self, db: Executor, settings: Settings, models: set[str], at: float) -> _Snapshot:
        with self._lock:
            snap = self._snapshot
            if snap is None or at - snap.at >= CACHE_SECONDS or at < snap.at:
                queued = views_repo.queued_batches(db)
                urgent = frozenset(b.batch_id for b in queued if is_urgent(b, settings.scheduler))
                snap = _Snapshot(at, queued, urgent, {})
                self._snapshot = snap
            for model in models - snap.rates.keys():
                snap.rates[model] = _rate(db, settings, model, at)
            return snap

    def clear(self) -> None:
        with self._lock:
            self._snapshot = None


def _rate(db: Executor, settings: Settings, model: str, at: float) -> float | None:
    since = at - settings.scheduler.throughput_window_seconds
    history = scheduler_repo.engine_history(db, model, since)  # type: ignore[arg-type]
    alive = at - max(3 * settings.flush_seconds, settings.lease_seconds)
    workers = scheduler_repo.live_workers(db, model, alive)  # type: ignore[arg-type]
    return lines_per_second(history, workers)


_cache = _Cache()


def clear_cache() -> None:
    """Forget the queue and rates read (the next poll reads them again)."""
    _cache.clear()


def _estimable(values: Mapping[str, Any]) -> bool:
    return (
        values["status"] == BatchStatus.IN_PROGRESS
        and values["model"] is not None
        and values.get("paused_at") is None
    )


def apply(
    db: Executor, settings: Settings, batches: Sequence[dict[str, Any]], at: float | None = None
) -> None:
    """Set ``estimated_completion_at``, ``slack_seconds`` and ``completion_warning`` of each
    Batch object of ``batches`` (``api.schemas.batches.batch_json`` dicts, changed in place)
    from the claim-order estimate, where a running batch's model has a measured rate; the
    scheduler's estimate stays where it has none. A paused batch shows none."""
    running = [b for b in batches if b["status"] == BatchStatus.IN_PROGRESS]
    if not running:
        return
    at = time.time() if at is None else at
    estimable = [b for b in running if _estimable(b)]
    snap = _cache.get(db, settings, {b["model"] for b in estimable}, at) if estimable else None
    for values in running:
        eta = values["estimated_completion_at"]
        if snap is not None and _estimable(values):
            counts = values["request_counts"]
            own = counts["total"] - counts["completed"] - counts["failed"]
            queued = [b for b in snap.queued if b.model == values["model"]]
            found = next((b for b in queued if b.batch_id == values["id"]), None)
            me = _as_queued(values, own, found)
            rate = snap.rates.get(values["model"])
            ahead = lines_ahead(me, queued, set(snap.urgent))
            measured = completion_at(at, ahead, own, rate)
            if measured is not None:
                eta = measured
        elif values.get("paused_at") is not None:
            eta = None
        values["estimated_completion_at"] = None if eta is None else int(eta)
        values["slack_seconds"] = (
            None if eta is None else float(round(values["expires_at"] - eta, 1))
        )
        values["completion_warning"] = warning(values["expires_at"], eta)


def _as_queued(values: Mapping[str, Any], own: int, found: QueuedBatch | None) -> QueuedBatch:
    """The polled batch as the queue counts it, with its current lines left."""
    if found is not None:
        return replace(found, left=own)
    return QueuedBatch(
        batch_id=values["id"],
        tenant_id="",  # not in the snapshot yet: counted as a tenant of its own
        weight=1.0,
        model=values["model"],
        left=own,
        expires_at=values["expires_at"],
        # The stored window: the create set ``expires_at`` to ``created_at`` plus it.
        window_seconds=values["expires_at"] - values["created_at"],
        estimated_completion_at=None,
    )
