"""Per-tenant views: where a tenant's queued lines stand under the fair share, its share of the
engines against the share its weight entitles it to, and its quota use (``GET /v1/queue``, the
dashboard, ``offpeak usage``; every tenant's for the operator: ``offpeak tenants list``,
``/v1/admin/tenants``, the dashboard with the admin key).

A tenant's own view carries counts only: no other tenant's name, id or batch.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from offpeak.settings import SchedulerSettings, Settings
from storage.db import Executor
from storage.repositories import tenant_views as views_repo
from storage.repositories.tenant_views import QueuedBatch, Served

#: The recent window a tenant's share of the engines is measured over, in seconds.
SHARE_WINDOW_SECONDS = 3600
#: The least weight a tenant counts with, as in the claims (``fair_share.MIN_WEIGHT``).
MIN_WEIGHT = 0.01


def is_urgent(batch: QueuedBatch, settings: SchedulerSettings) -> bool:
    """The deadline guard's rule (``docs/scheduling.md``): slack (``expires_at`` minus the
    estimated completion) below ``urgent_margin_fraction × window + urgent_margin_seconds``.
    A batch not estimated yet is not urgent."""
    if batch.estimated_completion_at is None:
        return False
    margin = settings.urgent_margin_fraction * batch.window_seconds + settings.urgent_margin_seconds
    return batch.expires_at - batch.estimated_completion_at < margin


@dataclass(frozen=True)
class QueuePosition:
    """One tenant's queued lines of one model and the lines of other tenants that will run
    before they are done: ``urgent_lines_ahead`` (the deadline guard's) and
    ``shared_lines_ahead`` (what the fair share serves others meanwhile)."""

    model: str
    queued_lines: int
    urgent_lines_ahead: int
    shared_lines_ahead: int

    @property
    def lines_ahead(self) -> int:
        return self.urgent_lines_ahead + self.shared_lines_ahead

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "queued_lines": self.queued_lines,
            "lines_ahead": self.lines_ahead,
            "urgent_lines_ahead": self.urgent_lines_ahead,
            "shared_lines_ahead": self.shared_lines_ahead,
        }


def positions(batches: Iterable[QueuedBatch], urgent: set[str]) -> dict[str, list[QueuePosition]]:
    """Each tenant's ``QueuePosition`` per model it has lines queued on, by model name.

    An approximation of the claims' rule (``workers.scheduler.fair_share``), from the queue as
    it stands: lines of ``urgent`` batches come first, so every urgent line of another tenant is
    ahead of a tenant's other lines (of its urgent lines, only those due no later). The rest is
    shared in proportion to the weights: while tenant T runs its ``q_T`` shared lines, tenant U
    is served ``q_T × w_U / w_T`` lines, at most the ``q_U`` it has queued, so
    ``shared_lines_ahead = Σ_U min(q_U, q_T × w_U / w_T)``, rounded up. It ignores the virtual
    time a tenant has already built up (which evens out within claims), lines finishing on
    other engines, and arrivals still to come."""
    by_model: dict[str, list[QueuedBatch]] = defaultdict(list)
    for batch in batches:
        by_model[batch.model].append(batch)
    out: dict[str, list[QueuePosition]] = defaultdict(list)
    for model in sorted(by_model):
        shared: dict[str, int] = defaultdict(int)
        weight: dict[str, float] = {}
        urgent_due: list[tuple[str, int, int]] = []  # (tenant, expires_at, lines)
        for batch in by_model[model]:
            weight[batch.tenant_id] = max(MIN_WEIGHT, batch.weight)
            if batch.batch_id in urgent:
                urgent_due.append((batch.tenant_id, batch.expires_at, batch.left))
            else:
                shared[batch.tenant_id] += batch.left
        for tenant in sorted(weight):
            own_urgent = [due for t, due, _ in urgent_due if t == tenant]
            # Shared lines wait for every other urgent line; urgent ones for those due first.
            cutoff = float("inf") if shared[tenant] else max(own_urgent)
            urgent_ahead = sum(n for t, due, n in urgent_due if t != tenant and due <= cutoff)
            mine = shared[tenant]
            share_ahead = sum(
                min(theirs, -(-mine * weight[other] // weight[tenant]))
                for other, theirs in shared.items()
                if other != tenant
            )
            out[tenant].append(
                QueuePosition(
                    model=model,
                    queued_lines=mine + sum(n for t, _, n in urgent_due if t == tenant),
                    urgent_lines_ahead=urgent_ahead,
                    shared_lines_ahead=int(share_ahead) if mine else 0,
                )
            )
    return dict(out)


def shares(
    served: Sequence[Served], weights: dict[str, float], window_seconds: int
) -> dict[str, dict[str, Any]]:
    """Each tenant's share of the engines over the window against its entitled share.

    ``engine_share`` is its engine-seconds over all tenants' (``lines_share`` the same for
    lines finished); ``entitled_share`` is its weight over the weights of the tenants competing
    (``weights``: those with lines queued now or served in the window), what the fair share
    gives a tenant that stays backlogged. ``None`` where nothing was served."""
    total_seconds = sum(s.engine_seconds for s in served)
    total_lines = sum(s.lines for s in served)
    by_tenant = {s.tenant_id: s for s in served}
    total_weight = sum(max(MIN_WEIGHT, w) for w in weights.values())
    out = {}
    for tenant, weight in weights.items():
        mine = by_tenant.get(tenant, Served(tenant, 0, 0.0))
        out[tenant] = {
            "window_seconds": window_seconds,
            "weight": weight,
            "entitled_share": max(MIN_WEIGHT, weight) / total_weight if total_weight else None,
            "engine_seconds": mine.engine_seconds,
            "engine_share": mine.engine_seconds / total_seconds if total_seconds else None,
            "lines_finished": mine.lines,
            "lines_share": mine.lines / total_lines if total_lines else None,
        }
    return out


def figures(
    db: Executor, settings: Settings, tenant_ids: Sequence[str], at: float | None = None
) -> dict[str, dict[str, Any]]:
    """``{"queue": [...], "share": {...}}`` of each tenant of ``tenant_ids``: its queue
    positions per model (``QueuePosition.as_json``) and its share of the engines over the last
    ``SHARE_WINDOW_SECONDS`` (``shares``). Counts only: nothing names another tenant."""
    at = time.time() if at is None else at
    queued = views_repo.queued_batches(db)
    urgent = {b.batch_id for b in queued if is_urgent(b, settings.scheduler)}
    queue = positions(queued, urgent)
    served = views_repo.served_since(db, at - SHARE_WINDOW_SECONDS)
    competing = {b.tenant_id for b in queued} | {s.tenant_id for s in served}
    weights = views_repo.weights(db, competing | set(tenant_ids))
    share = shares(served, {t: weights[t] for t in competing if t in weights}, SHARE_WINDOW_SECONDS)
    out = {}
    for tenant in tenant_ids:
        mine = share.get(tenant) or {
            **shares([], {tenant: weights.get(tenant, 1.0)}, SHARE_WINDOW_SECONDS)[tenant],
            "entitled_share": None,  # not competing: no work queued, nothing served
        }
        out[tenant] = {
            "queue": [p.as_json() for p in queue.get(tenant, [])],
            "share": mine,
        }
    return out
