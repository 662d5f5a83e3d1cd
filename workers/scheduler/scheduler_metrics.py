"""The scheduler's Prometheus metrics (load, gate, pause, slack, slots, yields, the batch lane),
in the process's default registry.

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
from workers.scheduler.lane import LaneDecision
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


# The batch lane (``workers.scheduler.lane``): batch requests in flight at a shared real-time
# server, and the readings each decision was taken on.
LANE_LIMIT = Gauge(
    "offpeak_lane_limit", "Batch requests the lane controller allows in flight.", ["model"]
)
LANE_IN_FLIGHT = Gauge(
    "offpeak_lane_in_flight", "Batch requests in flight at the real-time server.", ["model"]
)
LANE_TPOT_P95 = Gauge(
    "offpeak_lane_tpot_p95_seconds", "Windowed p95 inter-token latency at the server.", ["model"]
)
LANE_TTFT_P95 = Gauge(
    "offpeak_lane_ttft_p95_seconds", "Windowed p95 time to first token at the server.", ["model"]
)
LANE_TPOT_TARGET = Gauge(
    "offpeak_lane_tpot_target_seconds", "The lane's TPOT p95 target.", ["model"]
)
LANE_TTFT_TARGET = Gauge(
    "offpeak_lane_ttft_target_seconds", "The lane's TTFT p95 target (0: not yet known).", ["model"]
)
LANE_REQUEST_TPOT_P95 = Gauge(
    "offpeak_lane_request_tpot_p95_seconds",
    "Windowed p95 of finished requests' own TPOT at the server.",
    ["model"],
)
LANE_REQUEST_TPOT_TARGET = Gauge(
    "offpeak_lane_request_tpot_target_seconds",
    "The lane's target for finished requests' own TPOT p95 (0: not yet known).",
    ["model"],
)
LANE_REALTIME_WAITING = Gauge(
    "offpeak_lane_realtime_waiting", "Requests waiting at the real-time server.", ["model"]
)
LANE_DECISIONS = Counter(
    "offpeak_lane_decisions", "Lane controller decisions by action.", ["model", "action"]
)
LANE_ABORTED = Counter(
    "offpeak_lane_aborted_sequences",
    "Batch lines aborted (back to pending) because the lane's limit fell below them.",
    ["model"],
)


def observe_lane(model: str, decision: LaneDecision) -> None:
    LANE_LIMIT.labels(model).set(decision.limit)
    LANE_IN_FLIGHT.labels(model).set(decision.in_flight)
    LANE_REALTIME_WAITING.labels(model).set(decision.waiting)
    for gauge, value in (
        (LANE_TPOT_P95, decision.tpot_p95),
        (LANE_TTFT_P95, decision.ttft_p95),
        (LANE_TPOT_TARGET, decision.tpot_target),
        (LANE_TTFT_TARGET, decision.ttft_target or 0.0),
        (LANE_REQUEST_TPOT_P95, decision.request_tpot_p95),
        (LANE_REQUEST_TPOT_TARGET, decision.request_tpot_target or 0.0),
    ):
        if value is not None:
            gauge.labels(model).set(value)
    LANE_DECISIONS.labels(model, decision.action).inc()
