"""A simulated day: the real runner on a virtual clock, an engine timed by the step model,
a diurnal real-time load curve and batch arrivals.

Only the engine (``workers.sim.engine``), the store (``workers.sim.store``), the clock and the
load signal (``workers.sim.load``) are stand-ins; the loop, the gate, the slack estimates, the
claim sizing and the yield logic are ``workers.runner.Runner`` as a worker runs it. The engine's
decode step costs ``base + per_sequence × batch`` (by default 10 ms + 0.4 ms,
``docs/planning.md``), and every running sequence gains one token per step.
Time only moves when the engine steps or the runner waits, so a day takes seconds.

What it measures, over the simulated hours (``offpeak simulate day`` prints it):

- batches finished inside their window (%), following every batch to its end;
- batch tokens served (prompt and completion);
- the share of the valleys' idle capacity batch work used: engine-busy seconds while the
  real-time load was at or below the low-water mark, over the seconds it was;
- seconds of batch work while the real-time load was above the high-water mark.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from offpeak.settings import ModelConfig, SchedulerSettings, Settings
from offpeak.statuses import BatchStatus
from workers.planner import StepModel
from workers.scheduler.clock import VirtualClock
from workers.scheduler.signals import LoadMonitor
from workers.sim.engine import LLAMA3_8B_KV_CACHE_TOKENS, MODEL, SimEngine
from workers.sim.load import CurveSignal, LoadCurve, diurnal_curve
from workers.sim.store import Arrival, MemoryStore

#: 1 January 2026, 00:00 UTC: the simulated day starts at midnight.
DAY_START = 1_767_225_600.0


@dataclass(frozen=True)
class DayParams:
    """A simulated day. Loads are on the water-mark scale (0 idle, 1 saturated)."""

    hours: float = 24.0
    #: The replay starts at this hour of the curve's day. In steady state the night's batch work
    #: is done by the morning, so the default (08:00) starts with no backlog, as a real day does.
    start_hour: float = 8.0
    #: Batches arrive at uniform random times between these hours of the day (office hours by
    #: default: batch jobs are submitted by people and pipelines at work).
    arrivals_from_hour: float = 8.0
    arrivals_to_hour: float = 20.0
    #: 24 hourly real-time loads; ``None``: ``diurnal_curve()`` (0.05 at 02:00, 0.85 at 14:00).
    load_curve: tuple[float, ...] | None = None
    noise: float = 0.03
    #: Batch work offered over the day, as a multiple of what the valleys (load at or below
    #: low-water) can serve at full batch size. Work arriving while the gate is open runs at once
    #: (in the shoulders), so 1.2 leaves the valleys enough: an idle valley is then the
    #: scheduler's waste, not a lack of work.
    fill: float = 1.2
    batches: int = 40
    #: Reply lengths in tokens, uniform in the range (every reply runs to ``max_tokens``).
    min_reply: int = 400
    max_reply: int = 2400
    #: Each batch's requests share a system prompt of ``prefix_tokens`` and add their own.
    prefix_tokens: int = 48
    unique_tokens: int = 16
    window: str = "24h"
    base_ms: float = 10.0
    per_seq_ms: float = 0.4
    max_num_seqs: int = 256
    kv_cache_tokens: int = LLAMA3_8B_KV_CACHE_TOKENS
    seed: int = 0

    def curve(self) -> LoadCurve:
        return LoadCurve(self.load_curve or diurnal_curve(), self.noise, self.seed)

    def step_model(self) -> StepModel:
        return StepModel(self.base_ms, self.per_seq_ms)


@dataclass
class DayReport:
    params: DayParams
    low_water: float
    high_water: float
    batches: int
    inside_window: int
    expired: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    #: Completion tokens the day's batches asked for.
    offered_tokens: int
    #: Seconds of the simulated hours with real-time load at or below low-water, and of them
    #: the seconds the engine ran batch work.
    valley_seconds: float
    valley_busy_seconds: float
    #: Seconds the engine ran batch work while real-time load was above high-water.
    busy_above_high_seconds: float
    busy_seconds: float
    gate_changes: int
    yields: int
    aborted: int
    urgent_batches: int
    #: Hours after the replay's start when the last batch ended.
    last_end_hours: float
    wall_seconds: float

    @property
    def inside_window_pct(self) -> float:
        return 100.0 * self.inside_window / self.batches if self.batches else 100.0

    @property
    def valley_used_pct(self) -> float:
        return (
            100.0 * self.valley_busy_seconds / self.valley_seconds if self.valley_seconds else 0.0
        )


def valley_seconds(params: DayParams, low_water: float) -> float:
    """Seconds of the replayed hours whose real-time load is at or below ``low_water``."""
    curve, start = params.curve(), params.start_hour * 3600
    return float(
        sum(1 for s in range(int(params.hours * 3600)) if curve.at(start + s + 0.5) <= low_water)
    )


def make_arrivals(params: DayParams, low_water: float) -> list[Arrival]:
    """``params.batches`` batches at uniform random times between ``arrivals_from_hour`` and
    ``arrivals_to_hour`` (seconds after the replay's start in ``Arrival.at``), together
    asking for ``fill ×`` the completion tokens the valleys can serve at ``max_num_seqs``
    sequences per step, split among them at random; each batch's prompts share its system
    prompt."""
    rng = np.random.default_rng(params.seed)
    capacity = valley_seconds(params, low_water) * params.step_model().total_tokens_per_s(
        params.max_num_seqs
    )
    lines_total = params.fill * capacity / ((params.min_reply + params.max_reply) / 2)
    weights = rng.uniform(0.5, 1.5, params.batches)
    arrivals = []
    for b, weight in enumerate(weights):
        hour = rng.uniform(params.arrivals_from_hour, params.arrivals_to_hour)
        at = float((hour - params.start_hour) % 24) * 3600
        prefix = [1000 + (b * 7919 + i) % 30_000 for i in range(params.prefix_tokens)]
        n = max(1, round(lines_total * weight / weights.sum()))
        own = rng.integers(0, 30_000, (n, params.unique_tokens)).tolist()
        replies = rng.integers(params.min_reply, params.max_reply + 1, n).tolist()
        arrivals.append(Arrival(at, [(prefix + o, r) for o, r in zip(own, replies, strict=True)]))
    return arrivals


def simulate_day(
    params: DayParams | None = None,
    scheduler: SchedulerSettings | None = None,
    arrivals: Sequence[Arrival] | None = None,
) -> DayReport:
    """Run the day through ``workers.runner.Runner`` and measure it (see the module docstring).

    ``scheduler`` defaults to the defaults of ``SchedulerSettings``; its load signals are
    replaced by the curve. ``arrivals`` overrides the generated batches (tests).
    """
    from workers.runner import Runner  # the runner imports the engine stack lazily too

    params = params or DayParams()
    policy = scheduler or SchedulerSettings()
    curve = params.curve()
    start = DAY_START + params.start_hour * 3600
    horizon = params.hours * 3600
    clock = VirtualClock(start)
    measured = {"valley": 0.0, "above": 0.0, "busy": 0.0}

    def on_step(at: float, cost: float) -> None:
        measured["busy"] += cost
        offset = at - start
        if offset >= horizon:
            return
        load = curve.at(at - DAY_START)
        if load <= policy.low_water:
            measured["valley"] += min(cost, horizon - offset)
        elif load > policy.high_water:
            measured["above"] += cost

    engine = SimEngine(
        clock,
        params.step_model(),
        max_num_seqs=params.max_num_seqs,
        kv_cache_tokens=params.kv_cache_tokens,
        on_step=on_step,
    )
    arrivals = arrivals if arrivals is not None else make_arrivals(params, policy.low_water)
    store = MemoryStore(clock, arrivals, params.window, start)
    settings = Settings(
        models={MODEL: ModelConfig(engine="instant", max_num_seqs=params.max_num_seqs)},
        allowed_completion_windows=[params.window],
        scheduler=policy,
    )
    runner = Runner(
        settings,
        engine,  # type: ignore[arg-type]  # SimEngine implements the Engine protocol
        "simulated-worker",
        device="simulated",
        store=store,
        clock=clock,
        monitor=LoadMonitor([CurveSignal(curve, DAY_START)]),
        step_model=params.step_model(),
        export_metrics=False,
    )
    # The simulated day is the runner's business; its per-chunk INFO lines would flood the CLI.
    quiet = logging.getLogger("workers")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    started = time.perf_counter()
    limit = start + horizon + 7 * 86_400  # a stuck simulation ends after a week
    try:
        stats = runner.run(until=lambda: store.all_done() or clock.time() >= limit)
    finally:
        quiet.setLevel(level)
    wall = time.perf_counter() - started
    batches = list(store.batches.values())
    return DayReport(
        params=params,
        low_water=policy.low_water,
        high_water=policy.high_water,
        batches=len(batches),
        inside_window=sum(
            1
            for b in batches
            if b.status == BatchStatus.COMPLETED
            and b.ended_at is not None
            and b.ended_at <= b.expires_at
        ),
        expired=sum(1 for b in batches if b.status == BatchStatus.EXPIRED),
        requests=stats.requests,
        prompt_tokens=stats.prompt_tokens,
        cached_tokens=stats.cached_tokens,
        completion_tokens=stats.completion_tokens,
        offered_tokens=sum(reply for a in arrivals for _, reply in a.lines),
        valley_seconds=valley_seconds(params, policy.low_water),
        valley_busy_seconds=measured["valley"],
        busy_above_high_seconds=measured["above"],
        busy_seconds=measured["busy"],
        gate_changes=runner.gate.changes,
        yields=stats.yields,
        aborted=stats.aborted,
        urgent_batches=len(runner.urgent_seen),
        last_end_hours=max((((b.ended_at or start) - start) / 3600 for b in batches), default=0.0),
        wall_seconds=wall,
    )


def with_overrides(params: DayParams, **changes: Any) -> DayParams:
    """``params`` with the non-``None`` ``changes`` applied."""
    return replace(params, **{k: v for k, v in changes.items() if v is not None})
