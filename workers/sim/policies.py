"""Simulation of batching policies on one device: one at a time, static batches, continuous.

The three policies of ``docs/planning.md`` ("Batching policies") with every constant a
parameter: Poisson arrivals, replies of uniformly drawn lengths, decode steps timed by the step
model. With the defaults it gives that page's table: 427 requests, 46 finished one at a time,
continuous batching at about ten times that throughput with nothing left queued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from workers.planner import StepModel

POLICIES = ("one at a time", "static batches", "continuous batching")


@dataclass(frozen=True)
class Workload:
    """Arrival times (seconds, ascending, shape ``(n,)``) and reply lengths (tokens, ``(n,)``)."""

    arrivals: np.ndarray
    lengths: np.ndarray
    seconds: float


@dataclass(frozen=True)
class PolicyResult:
    """What one policy achieved over the simulated period.

    ``median_wait_s`` and ``p95_wait_s`` run from arrival to last token, over finished requests
    (NaN when none finished); ``still_queued`` counts requests not yet started at the end.
    """

    policy: str
    tokens_per_s: float
    finished: int
    median_wait_s: float
    p95_wait_s: float
    still_queued: int


def make_workload(
    rate: float = 4.0,
    seconds: float = 120.0,
    min_reply: int = 50,
    max_reply: int = 500,
    seed: int = 0,
) -> Workload:
    """Poisson arrivals at ``rate`` requests/s for ``seconds``, replies of ``min_reply`` to
    ``max_reply`` tokens (inclusive, uniform).

    Drawn in a fixed order: ``default_rng(seed)``, then ``2 × rate × seconds`` exponential
    gaps (cumulated, cut at ``seconds``), then the lengths. Raises ``ValueError`` for a
    non-positive rate or duration or an empty length range.
    """
    if rate <= 0 or seconds <= 0 or not 1 <= min_reply <= max_reply:
        raise ValueError("need rate > 0, seconds > 0 and 1 <= min_reply <= max_reply")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, math.ceil(2 * rate * seconds)))
    arrivals = arrivals[arrivals < seconds]
    lengths = rng.integers(min_reply, max_reply + 1, len(arrivals))
    return Workload(arrivals=arrivals, lengths=lengths, seconds=seconds)


def simulate(
    policy: str,
    workload: Workload,
    step: StepModel | None = None,
    max_batch: int = 32,
    static_size: int = 8,
) -> PolicyResult:
    """Run ``policy`` (one of ``POLICIES``) over ``workload`` with decode steps timed by ``step``.

    Requests join at the step after they arrive; one at a time runs a single request to its end;
    static batches wait for ``static_size`` requests and run them until the longest finishes;
    continuous batching refills up to ``max_batch`` slots before every step. Raises ``ValueError``
    for an unknown policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
    step = step or StepModel()
    arrivals, seconds = workload.arrivals, workload.seconds
    clock, arrived, tokens = 0.0, 0, 0
    waiting: list[int] = []
    active: list[int] = []
    latencies: list[float] = []
    left = workload.lengths.copy()
    while clock < seconds:
        while arrived < len(arrivals) and arrivals[arrived] <= clock:
            waiting.append(arrived)
            arrived += 1
        if policy == "one at a time" and not active and waiting:
            active = [waiting.pop(0)]
        elif policy == "static batches" and not active and len(waiting) >= static_size:
            active, waiting = waiting[:static_size], waiting[static_size:]
        elif policy == "continuous batching":
            while waiting and len(active) < max_batch:
                active.append(waiting.pop(0))
        if not active:
            # Idle until the next arrival; no step runs.
            clock = arrivals[arrived] if arrived < len(arrivals) else seconds
            continue
        clock += step.step_seconds(len(active))
        tokens += len(active)
        for r in active:
            left[r] -= 1
        latencies += [clock - arrivals[r] for r in active if left[r] == 0]
        active = [r for r in active if left[r] > 0]
    lat = np.array(latencies)
    empty = len(lat) == 0
    return PolicyResult(
        policy=policy,
        tokens_per_s=tokens / seconds,
        finished=len(lat),
        median_wait_s=math.nan if empty else float(np.median(lat)),
        p95_wait_s=math.nan if empty else float(np.percentile(lat, 95)),
        still_queued=len(waiting),
    )


def simulate_policies(
    rate: float = 4.0,
    seconds: float = 120.0,
    min_reply: int = 50,
    max_reply: int = 500,
    base_ms: float = 10.0,
    per_seq_ms: float = 0.4,
    static_size: int = 8,
    max_batch: int = 32,
    seed: int = 0,
) -> tuple[Workload, list[PolicyResult]]:
    """Every policy in ``POLICIES`` over one workload; defaults are ``docs/planning.md``'s.

    Returns the workload (for its request count) and one result per policy, in ``POLICIES``
    order. Raises ``ValueError`` as ``make_workload``, or for a batch size below 1.
    """
    if static_size < 1 or max_batch < 1:
        raise ValueError("batch sizes must be at least 1")
    workload = make_workload(rate, seconds, min_reply, max_reply, seed)
    step = StepModel(base_ms, per_seq_ms)
    results = [simulate(p, workload, step, max_batch, static_size) for p in POLICIES]
    return workload, results
