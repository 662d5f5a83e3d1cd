"""A simulated day: the real runner on a virtual clock, an engine that costs the seed's step time,
a diurnal real-time load curve and batch arrivals.

Only the engine, the store, the clock and the load signal are stand-ins; the loop, the gate,
the slack estimates, the claim sizing and the yield logic are ``workers.runner.Runner`` as a
worker runs it. The engine's decode step costs ``base + per_sequence × batch`` (the seed's
10 ms + 0.4 ms, ``shared/seed/serving-models.txt``), and every running sequence gains one token
per step. Time only moves when the engine steps or the runner waits, so a day takes seconds.

What it measures, over the simulated hours (``offpeak simulate day`` prints it):

- batches finished inside their window (%), following every batch to its end;
- batch tokens served (prompt and completion);
- the share of the valleys' idle capacity batch work used: engine-busy seconds while the
  real-time load was at or below the low-water mark, over the seconds it was;
- seconds of batch work while the real-time load was above the high-water mark.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import orjson

from offpeak.settings import ModelConfig, SchedulerSettings, Settings, window_seconds
from storage.repositories.requests import ClaimedRequest
from storage.repositories.scheduler import BatchBacklog, EngineHistory
from workers.engine.base import Completion, EngineRequest, EngineResult
from workers.planner import StepModel
from workers.scheduler.clock import VirtualClock
from workers.scheduler.signals import LoadMonitor, PauseState
from workers.scheduler.store import WriteBack, WriteBackReport

MODEL = "simulated-model"
#: 1 January 2026, 00:00 UTC: the simulated day starts at midnight.
DAY_START = 1_767_225_600.0
#: Seconds between the knots of the load curve (hourly values and noise are interpolated).
KNOT_SECONDS = 300
#: The seed's memory example: an 80 GB GPU serving Llama 3 8B (16 GB of weights) has room for
#: (80e9 − 16e9) / 131,072 bytes per token = 488,281 tokens of KV cache.
SEED_KV_BYTES_PER_TOKEN = 131_072
SEED_KV_CACHE_TOKENS = 488_281


def diurnal_curve(trough: float = 0.05, peak: float = 0.85, peak_hour: float = 14.0) -> list[float]:
    """24 hourly real-time loads on a cosine: ``peak`` at ``peak_hour``, ``trough`` 12 h later."""
    mid, amplitude = (peak + trough) / 2, (peak - trough) / 2
    return [mid + amplitude * math.cos(2 * math.pi * (h - peak_hour) / 24) for h in range(24)]


class LoadCurve:
    """A periodic day of real-time load: hourly values, linearly interpolated, plus smooth noise
    (a uniform draw in ``±noise`` every ``KNOT_SECONDS``, interpolated too), clipped at 0."""

    def __init__(self, hourly: Sequence[float], noise: float = 0.0, seed: int = 0) -> None:
        if len(hourly) != 24:
            raise ValueError("the load curve needs 24 hourly values")
        rng = random.Random(seed)
        knots_per_hour = 3600 // KNOT_SECONDS
        self.knots = []
        for k in range(24 * knots_per_hour):
            hour, frac = divmod(k / knots_per_hour, 1.0)
            a, b = hourly[int(hour)], hourly[(int(hour) + 1) % 24]
            jitter = rng.uniform(-noise, noise) if noise else 0.0
            self.knots.append(max(0.0, a + (b - a) * frac + jitter))

    def at(self, seconds: float) -> float:
        """The load ``seconds`` after midnight of the first day (the day repeats)."""
        position = (seconds % 86_400) / KNOT_SECONDS
        i = int(position)
        frac = position - i
        a, b = self.knots[i], self.knots[(i + 1) % len(self.knots)]
        return a + (b - a) * frac


class CurveSignal:
    """The load signal of the simulated real-time server: the curve at the virtual time."""

    name = "simulated"

    def __init__(self, curve: LoadCurve, start: float) -> None:
        self.curve, self.start = curve, start

    def read(self, at: float) -> float:
        return self.curve.at(at - self.start)


class SimEngine:
    """The ``Engine`` interface on a virtual clock: each step costs ``step_model`` seconds for
    the sequences running and gives each of them one token; a request finishes after
    ``max_tokens`` steps. At most ``max_num_seqs`` run; the rest wait, as in vLLM. Prompt blocks
    seen before count as cached tokens (prefix caching, with no eviction)."""

    block_size = 16
    kv_bytes_per_token = SEED_KV_BYTES_PER_TOKEN

    def __init__(
        self,
        clock: VirtualClock,
        step_model: StepModel,
        max_num_seqs: int = 256,
        kv_cache_tokens: int = SEED_KV_CACHE_TOKENS,
        max_model_len: int = 4096,
        on_step: Callable[[float, float], None] | None = None,
    ) -> None:
        self.model_name = MODEL
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.kv_cache_tokens = kv_cache_tokens
        self.clock, self.step_model, self.on_step = clock, step_model, on_step
        self.steps = 0
        self._waiting: deque[EngineRequest] = deque()
        self._running: dict[str, tuple[EngineRequest, int]] = {}
        self._finish: list[tuple[int, str]] = []
        self._seen_blocks: set[int] = set()

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return list(text.encode())

    def encode_text(self, text: str) -> list[int]:
        return list(text.encode())

    def add(self, request: EngineRequest) -> None:
        self._waiting.append(request)

    def _cached(self, prompt: list[int]) -> int:
        cached, hit = 0, True
        for end in range(self.block_size, len(prompt) + 1, self.block_size):
            key = hash(tuple(prompt[:end]))
            if hit and key in self._seen_blocks:
                cached = end
            else:
                hit = False
                self._seen_blocks.add(key)
        return cached

    def step(self) -> list[EngineResult]:
        while self._waiting and len(self._running) < self.max_num_seqs:
            request = self._waiting.popleft()
            cached = self._cached(request.prompt_token_ids)
            self._running[request.request_id] = (request, cached)
            finish = self.steps + max(1, request.sampling.max_tokens)
            heapq.heappush(self._finish, (finish, request.request_id))
        if not self._running:
            return []
        cost = self.step_model.step_seconds(len(self._running))
        if self.on_step is not None:
            self.on_step(self.clock.time(), cost)
        self.clock.advance(cost)
        self.steps += 1
        results = []
        while self._finish and self._finish[0][0] <= self.steps:
            _, request_id = heapq.heappop(self._finish)
            entry = self._running.pop(request_id, None)
            if entry is None:  # aborted
                continue
            request, cached = entry
            tokens = [0] * request.sampling.max_tokens
            completions = [Completion("", tokens, "length")] * request.sampling.n
            results.append(
                EngineResult(request_id, len(request.prompt_token_ids), cached, completions)
            )
        return results

    def abort(self, request_ids: list[str]) -> None:
        doomed = set(request_ids)
        for request_id in doomed:
            self._running.pop(request_id, None)
        if doomed:
            self._waiting = deque(r for r in self._waiting if r.request_id not in doomed)

    def num_unfinished(self) -> int:
        return len(self._running) + len(self._waiting)

    def close(self) -> None:
        self._waiting.clear()
        self._running.clear()


@dataclass
class SimBatch:
    id: str
    arrives_at: float
    expires_at: float
    window: str
    requests: int
    status: str = "in_progress"
    completed: int = 0
    failed: int = 0
    output_tokens: int = 0
    ended_at: float | None = None
    pending: deque[int] = field(default_factory=deque)


@dataclass
class SimRow:
    batch_id: str
    custom_id: str
    line_json: str
    status: str = "pending"
    attempts: int = 0


@dataclass(frozen=True)
class Arrival:
    """A batch submitted at ``at`` (seconds after the day starts) with ``(prompt token ids,
    reply tokens)`` per request line."""

    at: float
    lines: list[tuple[list[int], int]]


class MemoryStore:
    """The ``WorkStore`` interface in memory, with the sweep's expiry and the finalizer's
    completion built in (checked whenever the runner writes back or estimates)."""

    def __init__(
        self, clock: VirtualClock, arrivals: Sequence[Arrival], window: str, start: float
    ) -> None:
        self.clock = clock
        self.window = window
        self.start = start
        self._arrivals = deque(sorted(arrivals, key=lambda a: a.at))
        self.batches: dict[str, SimBatch] = {}
        self.rows: dict[int, SimRow] = {}
        self._next_row = 1
        self._chunks: deque[tuple[float, int, int, float]] = deque()
        # Requests, completion tokens and busy seconds of ``_chunks``.
        self._sums: list[float] = [0, 0, 0.0]
        self.claims = 0

    # The day's arrivals become batches when the clock reaches them.
    def _ingest(self, at: float) -> None:
        while self._arrivals and self.start + self._arrivals[0].at <= at:
            arrival = self._arrivals.popleft()
            batch_id = f"batch_sim{len(self.batches):04d}"
            batch = SimBatch(
                id=batch_id,
                arrives_at=self.start + arrival.at,
                expires_at=self.start + arrival.at + window_seconds(self.window),
                window=self.window,
                requests=len(arrival.lines),
            )
            for i, (prompt, reply) in enumerate(arrival.lines):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": reply}
                line = {"custom_id": f"r{i}", "url": "/v1/completions", "body": body}
                self.rows[self._next_row] = SimRow(batch_id, f"r{i}", orjson.dumps(line).decode())
                batch.pending.append(self._next_row)
                self._next_row += 1
            self.batches[batch_id] = batch

    def _sweep(self, at: float) -> None:
        for batch in self.batches.values():
            if batch.status != "in_progress":
                continue
            if batch.completed + batch.failed >= batch.requests:
                batch.status, batch.ended_at = "completed", at
            elif batch.expires_at <= at:
                batch.status, batch.ended_at = "expired", at
                batch.pending.clear()

    @property
    def arrivals_left(self) -> int:
        return len(self._arrivals)

    def all_done(self) -> bool:
        return not self._arrivals and all(b.status != "in_progress" for b in self.batches.values())

    def claim(
        self,
        model: str,
        limit: int,
        owner: str,
        at: float,
        lease_until: float,
        batch_ids: Collection[str] | None = None,
    ) -> list[ClaimedRequest]:
        self._ingest(at)
        self.claims += 1
        claimed: list[ClaimedRequest] = []
        runnable = sorted(
            (b for b in self.batches.values() if b.status == "in_progress" and b.expires_at > at),
            key=lambda b: (b.expires_at, b.id),
        )
        for batch in runnable:
            if batch_ids is not None and batch.id not in batch_ids:
                continue
            while batch.pending and len(claimed) < limit:
                row_id = batch.pending.popleft()
                row = self.rows[row_id]
                row.status, row.attempts = "running", row.attempts + 1
                claimed.append(
                    ClaimedRequest(row_id, batch.id, row.custom_id, row.line_json, row.attempts)
                )
            if len(claimed) >= limit:
                break
        return claimed

    def write_back(self, flush: WriteBack) -> WriteBackReport:
        for result in flush.results:
            row = self.rows[result.id]
            if row.status != "running":
                continue
            row.status = result.status
            batch = self.batches[row.batch_id]
            if row.status == "succeeded":
                batch.completed += 1
                batch.output_tokens += result.tokens.completion
            else:
                batch.failed += 1
            row.line_json = ""  # done: free the line
        if flush.per_batch:
            tokens = sum(t.completion_tokens for t in flush.per_batch.values())
            requests = sum(t.requests for t in flush.per_batch.values())
            self._chunks.append((flush.at, requests, tokens, flush.busy_seconds))
            self._sums[0] += requests
            self._sums[1] += tokens
            self._sums[2] += flush.busy_seconds
        self._sweep(flush.at)
        return WriteBackReport(
            {
                b: (self.batches[b].status, self.batches[b].expires_at)
                for b in flush.batch_ids
                if b in self.batches
            }
        )

    def release(
        self, owner: str, ids: Collection[int], batch_ids: Collection[str], *, count_attempt: bool
    ) -> int:
        released = 0
        for row_id in sorted(ids, reverse=True):  # back to the front, in their order
            row = self.rows[row_id]
            if row.status != "running":
                continue
            row.status = "pending"
            row.attempts -= 0 if count_attempt else 1
            batch = self.batches[row.batch_id]
            if batch.status == "in_progress":
                batch.pending.appendleft(row_id)
            released += 1
        return released

    def renew(self, owner: str, lease_until: float, ids: Collection[int]) -> int:
        return 0  # one simulated worker: leases never lapse

    def backlog(self, model: str) -> list[BatchBacklog]:
        at = self.clock.time()
        self._ingest(at)
        self._sweep(at)
        return [
            BatchBacklog(
                b.id, b.expires_at, b.window, b.requests, b.completed, b.failed, b.output_tokens
            )
            for b in self.batches.values()
            if b.status == "in_progress"
        ]

    def engine_history(self, model: str, since: float) -> EngineHistory:
        while self._chunks and self._chunks[0][0] < since:
            _, requests, tokens, busy = self._chunks.popleft()
            self._sums[0] -= requests
            self._sums[1] -= tokens
            self._sums[2] -= busy
        total_requests, total_tokens, total_busy = self._sums
        return EngineHistory(
            int(total_requests), int(total_tokens), max(0.0, float(total_busy)), "simulated"
        )

    def live_workers(self, model: str, since: float) -> int:
        return 1

    def save_estimates(self, estimates: Mapping[str, float | None]) -> None:
        return None

    def pause_state(self, pool: str) -> PauseState:
        return PauseState()

    def publish_load(self, pool: str, reading: dict[str, Any], at: float) -> None:
        return None


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
    kv_cache_tokens: int = SEED_KV_CACHE_TOKENS
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
            if b.status == "completed" and b.ended_at is not None and b.ended_at <= b.expires_at
        ),
        expired=sum(1 for b in batches if b.status == "expired"),
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
