"""The scheduler's Prometheus metrics (load, gate, pause, slack, slots, yields), in the process's
default registry; the batch lane's are ``workers.lane.lane_metrics``.

A worker exposes them on its own metrics endpoint (``OFFPEAK_METRICS_PORT``,
``workers.worker_metrics``) next to whatever else registers there; the API's fleet-wide
``/metrics`` (``api.services.fleet_metrics``) reads the same facts from the database (each
batch's ``estimated_completion_at``, the ``load:<pool>`` state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from prometheus_client import Counter, Gauge

from workers.scheduler.gate import Gate
from workers.scheduler.signals import LoadReading
from workers.scheduler.slack import Estimate

LOAD = Gauge("offpeak_scheduler_load", "Real-time load as the pool's signals read it.", ["pool"])
GATE_OPEN = Gauge(
    "offpeak_scheduler_gate_open",
    "1 while new batch work may start (load under the marks).",
    ["pool"],
)
PAUSED = Gauge("offpeak_scheduler_paused", "1 while the admin switch pauses the pool.", ["pool"])
SLACK = Gauge(
    "offpeak_batch_slack_seconds",
    "Seconds between a batch's estimated completion and its expires_at (negative: late).",
    ["model", "batch_id"],
)
ETA = Gauge(
    "offpeak_batch_estimated_completion_timestamp_seconds",
    "Estimated unix time a running batch's last line finishes.",
    ["model", "batch_id"],
)
URGENT = Gauge(
    "offpeak_scheduler_urgent_batches", "Batches whose slack is below their margin.", ["model"]
)
SLOTS = Gauge(
    "offpeak_engine_slots",
    "Sequences the runner keeps running: the chunk sizing decision.",
    ["model"],
)
PREFIX_HIT_RATE = Gauge(
    "offpeak_prefix_cache_hit_ratio",
    "cached_tokens / prompt_tokens of this worker's finished requests since it started.",
    ["model"],
)
YIELDS = Counter(
    "offpeak_scheduler_yields", "Times batch work yielded to real-time load.", ["model"]
)
ABORTED = Counter(
    "offpeak_scheduler_aborted_sequences",
    "Running sequences aborted (and returned to pending) on a yield.",
    ["model"],
)


def observe_gate(pool: str, reading: LoadReading, gate: Gate) -> None:
    LOAD.labels(pool).set(reading.load)
    GATE_OPEN.labels(pool).set(1 if gate.open else 0)
    PAUSED.labels(pool).set(1 if reading.pause.paused else 0)


def observe_estimates(model: str, estimates: Iterable[Estimate], ended: Iterable[str]) -> None:
    urgent = 0
    for e in estimates:
        SLACK.labels(model, e.batch_id).set(e.slack_seconds)
        ETA.labels(model, e.batch_id).set(e.estimated_completion_at)
        urgent += e.urgent
    URGENT.labels(model).set(urgent)
    for batch_id in ended:  # one series per running batch, not per batch ever run
        for gauge in (SLACK, ETA):
            with contextlib.suppress(KeyError):
                gauge.remove(model, batch_id)


def observe_prefix_hit_rate(model: str, hit_rate: float) -> None:
    """The worker's running cached / prompt tokens ratio (the token counters themselves are
    ``offpeak_worker_tokens_total{kind="prompt"|"cached"}``, ``workers.worker_metrics``)."""
    PREFIX_HIT_RATE.labels(model).set(hit_rate)
