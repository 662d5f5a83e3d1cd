"""A worker's own Prometheus endpoint and the load-signal history.

Each worker process can serve ``/metrics`` on ``settings.metrics_port`` (0: off), next to the
API's fleet-wide endpoint (``api.services.fleet_metrics``):

- every worker: process metrics, and the batches it billed (``offpeak_worker_batches_billed_total``,
  ``offpeak_worker_billing_failures_total``, ``offpeak_worker_batch_completion_window_share``);
- an engine worker also: its own engine busy fraction and prompt/completion tokens/s per model,
  from the engine chunks it recorded (``offpeak_worker_engine_busy_ratio`` and
  ``offpeak_worker_{prompt,completion}_tokens_per_second``);
- ``observe_flush`` and ``observe_queue_wait`` are the runner's hooks for in-process counters.

``sample_load`` (run by the sweep) copies the scheduler's current load readings from
``scheduler_state`` into ``load_samples``, so the dashboard can chart load over the last hours.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from offpeak import scheduler_state
from offpeak.settings import Settings
from storage.db import session_scope
from storage.repositories import fleet_stats
from storage.repositories.billing import WINDOW_SHARE_BUCKETS

log = logging.getLogger(__name__)

BATCHES_BILLED = Counter(
    "offpeak_worker_batches_billed", "Batches this process wrote a bill for.", ["status"]
)
BILLING_FAILURES = Counter(
    "offpeak_worker_billing_failures", "Billing steps that failed here (the sweep retries them)."
)
COMPLETION_SHARE = Histogram(
    "offpeak_worker_batch_completion_window_share",
    "Time from creation to completion of batches billed here, as a share of their window.",
    buckets=WINDOW_SHARE_BUCKETS,
)
BUSY_SECONDS = Counter(
    "offpeak_worker_engine_busy_seconds", "Seconds this worker's engine spent stepping.", ["model"]
)
TOKENS = Counter(
    "offpeak_worker_tokens", "Tokens of requests that finished here.", ["model", "kind"]
)
REQUESTS = Counter("offpeak_worker_requests", "Requests that finished here.", ["model"])
ENGINE_FAILURES = Counter(
    "offpeak_worker_engine_failures",
    "Times this worker's engine died or failed; its lines went back to pending.",
    ["model"],
)
POISON_LINES = Counter(
    "offpeak_worker_poison_lines",
    "Lines failed alone after running in max_line_attempts engine failures.",
    ["model"],
)
ENGINE_RELEASED = Gauge(
    "offpeak_worker_engine_released",
    "1 while this worker's engine is released: memory freed while batch work is held back.",
    ["model"],
)
ENGINE_RELOAD_SECONDS = Histogram(
    "offpeak_worker_engine_reload_seconds",
    "Seconds a released engine took to come back (how: sleep = vLLM wake_up, load = new engine).",
    ["model", "how"],
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
)
QUEUE_WAIT = Histogram(
    "offpeak_worker_request_queue_wait_seconds",
    "Seconds from a batch becoming runnable to a worker claiming one of its lines.",
    ["model"],
    buckets=(1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 24 * 3600),
)


def observe_billed(status: str, window_share: float | None) -> None:
    BATCHES_BILLED.labels(status).inc()
    if window_share is not None:
        COMPLETION_SHARE.observe(window_share)


def observe_billing_failure() -> None:
    BILLING_FAILURES.inc()


def observe_flush(
    model: str,
    busy_seconds: float,
    requests: int,
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
) -> None:
    """Runner hook: count one committed flush (the engine chunk it recorded)."""
    BUSY_SECONDS.labels(model).inc(busy_seconds)
    REQUESTS.labels(model).inc(requests)
    TOKENS.labels(model, "prompt").inc(prompt_tokens)
    TOKENS.labels(model, "cached").inc(cached_tokens)
    TOKENS.labels(model, "completion").inc(completion_tokens)


def observe_queue_wait(model: str, waits: Iterable[float]) -> None:
    """Runner hook: seconds each claimed line waited (claim time − its batch's in_progress_at)."""
    histogram = QUEUE_WAIT.labels(model)
    for seconds in waits:
        histogram.observe(max(seconds, 0.0))


class EngineCollector(Collector):
    """This engine worker's busy fraction and tokens/s per model over the metrics window, read
    from the engine chunks it recorded (``worker_id`` is the runner's lease owner)."""

    def __init__(self, settings: Settings, worker_id: str) -> None:
        self.settings = settings
        self.worker_id = worker_id

    def collect(self) -> Iterator[Metric]:
        window = self.settings.metrics_window_seconds
        busy = GaugeMetricFamily(
            "offpeak_worker_engine_busy_ratio",
            f"Share of the last {window:.0f} s this worker's engine spent stepping.",
            labels=["model"],
        )
        prompt = GaugeMetricFamily(
            "offpeak_worker_prompt_tokens_per_second",
            f"Prompt tokens/s of requests that finished here in the last {window:.0f} s.",
            labels=["model"],
        )
        completion = GaugeMetricFamily(
            "offpeak_worker_completion_tokens_per_second",
            f"Completion tokens/s of requests that finished here in the last {window:.0f} s.",
            labels=["model"],
        )
        try:
            with session_scope(self.settings.resolved_database_url) as session:
                rows = fleet_stats.engine_window(session, time.time() - window, self.worker_id)
        except Exception:  # a scrape must not take the worker down with the database
            log.exception("worker metrics: database unavailable")
            rows = []
        for row in rows:
            busy.add_metric([row.model], min(row.busy_seconds / window, 1.0))
            prompt.add_metric([row.model], row.prompt_tokens / window)
            completion.add_metric([row.model], row.completion_tokens / window)
        yield from (busy, prompt, completion)


_started: dict[str, int] = {}


def start_server(settings: Settings, role: str, worker_id: str) -> int | None:
    """Serve this process's ``/metrics`` on ``settings.metrics_port`` (bound to
    ``settings.api_host``), once per process; returns the port, or None when the port is 0 or
    taken (each worker on a host needs its own port)."""
    if not settings.metrics_port:
        return None
    if "port" in _started:
        return _started["port"]
    try:
        start_http_server(settings.metrics_port, addr=settings.api_host)
    except OSError as exc:  # the worker's job is batch work: run it without metrics, loudly
        log.error("metrics port %d unavailable (%s): no /metrics here", settings.metrics_port, exc)
        return None
    if role == "engine":
        REGISTRY.register(EngineCollector(settings, worker_id))
    _started["port"] = settings.metrics_port
    log.info("%s worker metrics on %s:%d", role, settings.api_host, settings.metrics_port)
    return settings.metrics_port


def sample_load(settings: Settings, at: float | None = None) -> int:
    """Record the current ``load:<source>`` readings (with the pause switch) as load samples and
    drop samples older than ``load_history_hours``. Returns the number of samples written."""
    at = time.time() if at is None else at
    with session_scope(settings.resolved_database_url) as session:
        state = fleet_stats.scheduler_state(session)
        paused = scheduler_state.paused_of(state.get(scheduler_state.PAUSE_ALL_KEY))
        samples = []
        for source, load in scheduler_state.loads(state).items():
            if load is not None:
                value = state[scheduler_state.load_key(source)]
                # A reading says whether its pool was paused; older or foreign ones may not.
                held = value.get("paused") if isinstance(value, dict) else None
                flag = paused if held is None else bool(held)
                samples.append({"at": at, "source": source, "load": load, "paused": flag})
        fleet_stats.add_load_samples(session, samples)
        fleet_stats.prune_load_samples(session, at - settings.load_history_hours * 3600)
    return len(samples)
