"""The batch lane's Prometheus metrics, in the process's default registry: batch requests in
flight at a shared real-time server, and the readings each decision was taken on. Exposed with
the scheduler's (``workers.scheduler.scheduler_metrics``) on the worker's metrics endpoint."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from workers.lane.controller import LaneDecision

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
    """The readings and the limit of ``decision``, the controller's latest for ``model``."""
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
