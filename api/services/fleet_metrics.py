"""``/metrics``: the fleet's state in Prometheus' text format, read from the database at scrape
time (the API has no engine of its own; every worker writes what it does to the database).

Series (``offpeak_`` prefix; ``model`` is the served model name):

- ``queue_requests{model,status}``: request lines not finished (``pending``, ``running``);
  ``queue_tokens{model}``: their estimated prompt tokens (JSON bytes / 4, the usual ~4 characters
  per token of English text; exact counts exist only once the engine has tokenized a line).
- ``queue_wait_seconds{model}`` (gauge histogram): how long each pending line has waited so far
  (since its batch became runnable); ``queue_oldest_wait_seconds{model}``.
- ``batches{status}``: batches per status.
- ``prompt_tokens_per_second{model}``, ``completion_tokens_per_second{model}``: tokens of requests
  that finished in the last ``metrics_window_seconds``, per second.
- ``engine_busy_ratio{model,worker,device}``: share of that window the engine spent stepping.
- ``cost_per_million_tokens{model}``: our engine cost per million tokens over that window.
- ``batch_completion_window_share`` (histogram over every billed completed batch) and
  ``batch_completion_window_share_quantile{quantile}`` (p50/p95/p99 of the last 24 h): time from
  creation to completion as a share of the completion window.
- ``billed_tokens_total``, ``billed_gpu_seconds_total``, ``billed_cost_dollars_total``,
  ``billed_price_dollars_total`` ``{model}``: the ledger's sums.
- ``load{source}`` and ``batch_work_paused{pool}``: the scheduler's load signal per pool and its
  admin pause switch (pool ``*``: every pool), from ``scheduler_state`` keys ``load:<pool>``,
  ``paused`` and ``paused:<pool>`` (no ``load`` series until the scheduler writes a reading).
- ``replicas_needed{model}``: engines needed to finish every running batch of the model before
  its deadline (minus its margin) at the measured tokens/s of one engine, the autoscaling hint
  for KEDA or an HPA (``docs/scheduling.md``); the control worker's sweep stores it every
  ``sweep_seconds`` (``workers.scheduler.slack.replicas_needed``), 0 once nothing is left.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session

from offpeak import billing, scheduler_state
from offpeak.settings import Settings
from offpeak.statuses import BatchStatus
from storage.db import session_scope
from storage.repositories import billing as billing_repo
from storage.repositories import fleet_stats

log = logging.getLogger(__name__)

STATUSES = tuple(BatchStatus)
#: Bytes of a request line per prompt token, for the queue's token estimate.
BYTES_PER_TOKEN = 4
WAIT_BUCKETS = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 24 * 3600)
QUANTILES = (0.5, 0.95, 0.99)
QUANTILE_SPAN_SECONDS = 86_400


def _le(bound: float) -> str:
    return str(float(bound))


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (non-empty)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def _queue(session: Session, at: float) -> Iterator[Metric]:
    requests = GaugeMetricFamily(
        "offpeak_queue_requests", "Request lines not finished yet.", labels=["model", "status"]
    )
    tokens = GaugeMetricFamily(
        "offpeak_queue_tokens",
        f"Estimated prompt tokens of unfinished request lines (JSON bytes / {BYTES_PER_TOKEN}).",
        labels=["model"],
    )
    queued_bytes: dict[str, int] = defaultdict(int)
    for model, status, count, size in fleet_stats.queue_depth(session):
        requests.add_metric([model, status], count)
        queued_bytes[model] += size
    for model, size in queued_bytes.items():
        tokens.add_metric([model], size // BYTES_PER_TOKEN)
    wait = GaugeHistogramMetricFamily(
        "offpeak_queue_wait_seconds",
        "Seconds each pending request line has waited so far since its batch became runnable.",
        labels=["model"],
    )
    oldest = GaugeMetricFamily(
        "offpeak_queue_oldest_wait_seconds",
        "Seconds the longest-waiting pending request line has waited.",
        labels=["model"],
    )
    waits: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for model, since, count in fleet_stats.pending_since(session):
        waits[model].append((max(at - since, 0.0), count))
    for model, rows in waits.items():
        buckets = [(_le(b), sum(n for w, n in rows if w <= b)) for b in WAIT_BUCKETS]
        buckets.append(("+Inf", sum(n for _, n in rows)))
        wait.add_metric([model], buckets, sum(w * n for w, n in rows))
        oldest.add_metric([model], max(w for w, _ in rows))
    yield from (requests, tokens, wait, oldest)


def _engines(session: Session, settings: Settings, at: float) -> Iterator[Metric]:
    window = settings.metrics_window_seconds
    prompt = GaugeMetricFamily(
        "offpeak_prompt_tokens_per_second",
        f"Prompt tokens/s of requests that finished in the last {window:.0f} s.",
        labels=["model"],
    )
    completion = GaugeMetricFamily(
        "offpeak_completion_tokens_per_second",
        f"Completion tokens/s of requests that finished in the last {window:.0f} s.",
        labels=["model"],
    )
    busy = GaugeMetricFamily(
        "offpeak_engine_busy_ratio",
        f"Share of the last {window:.0f} s each engine spent stepping (its busy fraction).",
        labels=["model", "worker", "device"],
    )
    cost = GaugeMetricFamily(
        "offpeak_cost_per_million_tokens",
        f"Engine cost in US dollars per million (prompt + completion) tokens, last {window:.0f} s.",
        labels=["model"],
    )
    per_model: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for row in fleet_stats.engine_window(session, at - window):
        busy.add_metric([row.model, row.worker_id, row.device], min(row.busy_seconds / window, 1))
        sums = per_model[row.model]
        sums[0] += row.prompt_tokens
        sums[1] += row.completion_tokens
        rate = billing.gpu_cost_per_hour(settings, row.model, row.device)
        sums[2] += row.busy_seconds * rate / 3600
    for model, (prompt_tokens, completion_tokens, dollars) in per_model.items():
        prompt.add_metric([model], prompt_tokens / window)
        completion.add_metric([model], completion_tokens / window)
        if prompt_tokens + completion_tokens:
            cost.add_metric([model], dollars / (prompt_tokens + completion_tokens) * 1e6)
    yield from (prompt, completion, busy, cost)


def _batches(session: Session, at: float) -> Iterator[Metric]:
    counts = fleet_stats.batches_by_status(session)
    batches = GaugeMetricFamily("offpeak_batches", "Batches per status.", labels=["status"])
    for status in sorted({*STATUSES, *counts}):
        batches.add_metric([status], counts.get(status, 0))
    yield batches
    bounds = billing_repo.WINDOW_SHARE_BUCKETS
    cumulative, count, total = billing_repo.completion_share_buckets(session, bounds)
    share = HistogramMetricFamily(
        "offpeak_batch_completion_window_share",
        "Time from creation to completion of completed batches, as a share of their window.",
    )
    share.add_metric([], [*zip(map(_le, bounds), cumulative, strict=True), ("+Inf", count)], total)
    yield share
    recent = billing_repo.completion_shares_since(session, int(at - QUANTILE_SPAN_SECONDS))
    quantiles = GaugeMetricFamily(
        "offpeak_batch_completion_window_share_quantile",
        "p50/p95/p99 of time to complete as a share of the window, batches of the last 24 h.",
        labels=["quantile"],
    )
    for q in QUANTILES if recent else ():
        quantiles.add_metric([str(q)], quantile(recent, q))
    yield quantiles


def _ledger(session: Session) -> Iterator[Metric]:
    families = {
        "tokens": CounterMetricFamily(
            "offpeak_billed_tokens", "Tokens billed (prompt + completion).", labels=["model"]
        ),
        "seconds": CounterMetricFamily(
            "offpeak_billed_gpu_seconds",
            "Engine seconds attributed to billed batches.",
            labels=["model"],
        ),
        "cost": CounterMetricFamily(
            "offpeak_billed_cost_dollars", "Our engine cost of billed batches.", labels=["model"]
        ),
        "price": CounterMetricFamily(
            "offpeak_billed_price_dollars", "Price billed for batches.", labels=["model"]
        ),
    }
    for model, tokens, seconds, cost, price in billing_repo.totals_by_model(session):
        label = [model or ""]
        families["tokens"].add_metric(label, tokens)
        families["seconds"].add_metric(label, seconds)
        families["cost"].add_metric(label, float(cost))
        families["price"].add_metric(label, float(price))
    yield from families.values()


def _scheduler(session: Session) -> Iterator[Metric]:
    state = fleet_stats.scheduler_state(session)
    load = GaugeMetricFamily(
        "offpeak_load", "The real-time load signal the scheduler reads.", labels=["source"]
    )
    for pool, reading in sorted(scheduler_state.loads(state).items()):
        if reading is not None:
            load.add_metric([pool], reading)
    yield load
    paused = GaugeMetricFamily(
        "offpeak_batch_work_paused",
        "1 while the admin switch pauses batch work (pool * : every pool).",
        labels=["pool"],
    )
    for pool, on in sorted(scheduler_state.pauses(state).items()):
        paused.add_metric([pool], float(on))
    yield paused
    replicas = GaugeMetricFamily(
        "offpeak_replicas_needed",
        "Engines needed to finish every running batch before its deadline at measured tokens/s.",
        labels=["model"],
    )
    for model, count in sorted(scheduler_state.replicas(state).items()):
        replicas.add_metric([model], float(count))
    yield replicas


def collect(session: Session, settings: Settings, at: float | None = None) -> Iterator[Metric]:
    """Every fleet series, read in one session at unix time ``at`` (default: now)."""
    at = time.time() if at is None else at
    yield from _queue(session, at)
    yield from _engines(session, settings, at)
    yield from _batches(session, at)
    yield from _ledger(session)
    yield from _scheduler(session)


class FleetCollector(Collector):
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def collect(self) -> Iterator[Metric]:
        # One short session per scrape on a cache miss, not one per HTTP request: a cached
        # answer needs no database at all.
        with session_scope(self.settings.resolved_database_url) as session:
            families = list(collect(session, self.settings))
        yield from families


_cache: dict[str, tuple[float, bytes]] = {}


def exposition(settings: Settings) -> bytes:
    """The text format of the fleet series plus this API process's own, reused for
    ``metrics_cache_seconds`` so many scrapers cost one set of queries."""
    key = settings.resolved_database_url
    hit = _cache.get(key)
    if hit is not None and time.monotonic() - hit[0] < settings.metrics_cache_seconds:
        return hit[1]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(settings))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    body = generate_latest(registry)
    _cache[key] = (time.monotonic(), body)
    return body
