"""The dashboard's data: the tenant's latest batches with their figures, its own throughput,
engine time, cost per million tokens and queue per model (never the fleet's: another tenant's
work moves none of a tenant's figures), its queue positions, engine share and quota use, the
last hours of its batch tokens/s against the real-time load signal, and the workers that are
missing (a model with no live engine worker, no control worker). With the admin key: the
fleet's figures per model and every tenant's instead."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from sqlalchemy.orm import Session

from api.services import batches as batches_service
from api.services import billing as billing_service
from api.services import health as health_service
from api.services import quotas as quotas_service
from api.services import tenant_views
from api.services import tenants as tenants_service
from offpeak import billing, scheduler_state
from offpeak.settings import Settings
from offpeak.statuses import LineStatus
from storage.repositories import fleet_stats

#: Points per series on the chart: a bucket is ``hours × 3600 / POINTS`` seconds (5 s to 1 h).
POINTS = 180


def bucket_seconds(hours: float) -> int:
    return int(min(max(round(hours * 3600 / POINTS), 5), 3600))


def _models(
    session: Session, settings: Settings, tenant_id: str | None, at: float
) -> list[dict[str, Any]]:
    """Per model over the last ``metrics_window_seconds``: queued and running lines, prompt and
    completion tokens/s and cost per million tokens (US dollars).

    For a tenant, every figure is its own batches' (its share of each engine chunk, the chunk's
    busy seconds split by requests) and ``engine_seconds`` is that share: nothing another
    tenant's work moves. For the operator (``tenant_id`` None), the fleet's, with
    ``busy_ratio``: the engines' mean busy fraction."""
    window = settings.metrics_window_seconds
    rows: dict[str, dict[str, Any]] = defaultdict(
        lambda: {
            "queued_requests": 0,
            "running_requests": 0,
            "prompt_tokens_per_second": 0.0,
            "completion_tokens_per_second": 0.0,
            "busy": 0.0,
            "engines": 0,
            "cost": 0.0,
            "tokens": 0,
        }
    )
    for model, status, count, _size in fleet_stats.queue_depth(session, tenant_id):
        queued = status == LineStatus.PENDING
        rows[model]["queued_requests" if queued else "running_requests"] += count
    for engine in fleet_stats.engine_window(session, at - window, tenant_id=tenant_id):
        row = rows[engine.model]
        row["busy"] += engine.busy_seconds if tenant_id else min(engine.busy_seconds / window, 1)
        row["engines"] += 1
        rate = billing.gpu_cost_per_hour(settings, engine.model, engine.device)
        row["cost"] += engine.busy_seconds * rate / 3600
        row["tokens"] += engine.prompt_tokens + engine.completion_tokens
        row["prompt_tokens_per_second"] += engine.prompt_tokens / window
        row["completion_tokens_per_second"] += engine.completion_tokens / window
    out = []
    for model, row in sorted(rows.items()):
        busy, engines = row.pop("busy"), row.pop("engines")
        cost, tokens = row.pop("cost"), row.pop("tokens")
        if tenant_id is None:
            row["busy_ratio"] = busy / engines if engines else 0.0
        else:
            row["engine_seconds"] = busy
        # The same rule as a batch's and /v1/usage's figure, so the cards and the CLI agree.
        per_million = billing.cost_per_million_tokens(cost, tokens)
        row["cost_per_million_tokens"] = per_million
        row["display"] = {"cost_per_million_tokens": billing.format_usd(per_million)}
        out.append({"model": model, **row})
    return out


def _with_display(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch's JSON plus ``display``: its amounts as the page shows them, formatted here by
    ``offpeak.billing.format_usd`` (the CLI's function) rather than again in JavaScript."""
    shown = ("cost", "price", "saving", "realtime_price", "cost_per_million_tokens")
    return {**batch, "display": {k: billing.format_usd(batch.get(k)) for k in shown}}


def _adapters(session: Session, tenant_id: str) -> list[dict[str, Any]]:
    """The tenant's billed usage of the last 30 days per model and LoRA adapter (``/v1/usage``
    grouped by ``adapter``), with ``display`` amounts."""
    report = billing_service.report(session, tenant_id, start=None, end=None, group_by="adapter")
    return [_with_display(bucket.model_dump()) for bucket in report.data]


def _series(session: Session, tenant_id: str, at: float, hours: float) -> dict[str, Any]:
    step = bucket_seconds(hours)
    since = at - hours * 3600
    first = int(since // step) * step
    times = list(range(first, int(at // step) * step + 1, step))
    tokens: dict[str, dict[int, float]] = defaultdict(dict)
    for bucket, model, _prompt, completion in fleet_stats.throughput_series(
        session, since, step, tenant_id
    ):
        tokens[model][bucket] = completion / step
    load: dict[str, list[list[float]]] = defaultdict(list)
    for sample_at, source, value, _paused in fleet_stats.load_series(session, since):
        load[source].append([sample_at, value])
    return {
        "bucket_seconds": step,
        "start": first,
        "end": at,
        "completion_tokens_per_second": {
            model: [[t, by_time.get(t, 0.0)] for t in times]
            for model, by_time in sorted(tokens.items())
        },
        "load": dict(sorted(load.items())),
    }


def _service_state(session: Session, settings: Settings, at: float) -> dict[str, Any]:
    state = fleet_stats.scheduler_state(session)
    return {
        "generated_at": at,
        "window_seconds": settings.metrics_window_seconds,
        "paused": sorted(pool for pool, on in scheduler_state.pauses(state).items() if on),
        "load": dict(sorted(scheduler_state.loads(state).items())),
        # Models no live engine worker serves, a missing control worker: why work may not move.
        "alerts": health_service.alerts(session, settings, at),
    }


def data(
    session: Session, settings: Settings, tenant_id: str, *, hours: float, limit: int = 20
) -> dict[str, Any]:
    """Everything the page shows, as JSON-ready values (amounts in US dollars); ``tenant``:
    the tenant's queue positions, engine share (``api.services.tenant_views``) and quota use
    (``GET /v1/limits``'s figures)."""
    at = time.time()
    batches, _ = batches_service.page(session, settings, tenant_id, after=None, limit=limit)
    return {
        **_service_state(session, settings, at),
        "tenant": {
            **tenant_views.figures(session, settings, [tenant_id], at)[tenant_id],
            "limits": quotas_service.of_tenant(session, settings, tenant_id),
        },
        "batches": [_with_display(batch) for batch in batches],
        "models": _models(session, settings, tenant_id, at),
        "adapters": _adapters(session, tenant_id),
        "series": _series(session, tenant_id, at, hours),
    }


def operator_data(session: Session, settings: Settings) -> dict[str, Any]:
    """What the page shows the operator (the admin key): the service's state, the fleet's
    figures per model (``_models``) and every tenant's view
    (``api.services.tenants.list_tenants``: limits, use, queue, share)."""
    at = time.time()
    return {
        **_service_state(session, settings, at),
        "operator": True,
        "models": _models(session, settings, None, at),
        "tenants": tenants_service.list_tenants(session, settings),
    }
