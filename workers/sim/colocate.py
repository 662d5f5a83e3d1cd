"""Co-serving on paper: the batch lane's controller against a simulated real-time server.

One simulated vLLM server on a virtual clock runs real-time requests (open-loop Poisson arrivals,
replies of 50-500 tokens as in ``offpeak simulate policies``) and the batch lines
``workers.runner.Runner`` sends it, in the same continuous batch: every decode step costs ``base +
per_sequence × running`` (by default the step model's GPU-like 10 ms + 0.4 ms,
``docs/planning.md``), every running sequence gains one token, real-time requests are scheduled
first (vLLM's priority policy) and at most ``max_num_seqs`` run. The server keeps the Prometheus
histograms a real one exposes (inter-token latency, TTFT, running, waiting), which the real
controller (``workers.lane.controller``) reads. Prefill is not costed (the step model has no term
for it), so TTFT here is queueing plus one step.

Phases quiet → busy → quiet (real-time rate as a fraction of the server's real-time capacity at
the TPOT target), legs: (a) real-time alone, (b) batch with the lane off (``max_num_seqs`` in
flight), (c) the lane at its defaults. ``offpeak simulate colocate`` prints it.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from offpeak.settings import LaneSettings, ModelConfig, SchedulerSettings, Settings
from workers.engine.base import Completion, EngineCapabilities, EngineRequest, EngineResult
from workers.lane.controller import bound_tokens_per_s, realtime_capacity
from workers.planner import StepModel, largest_batch
from workers.scheduler.clock import VirtualClock
from workers.sim.day import DAY_START
from workers.sim.engine import MODEL
from workers.sim.store import Arrival, MemoryStore
from workers.vllm_metrics import Histogram, ServerSnapshot

#: Bucket bounds (seconds) of the simulated histograms: fine enough for steps of 10-100 ms.
BUCKETS = tuple(x / 1000 for x in (*range(5, 100, 2), *range(100, 500, 10), 500, 1000, 2000))
BUCKETS_INF = (*BUCKETS, math.inf)
WINDOW = "365d"


class _Hist:
    def __init__(self) -> None:
        self.counts = [0.0] * len(BUCKETS_INF)

    def observe(self, value: float, times: float = 1.0) -> None:
        i = int(np.searchsorted(BUCKETS, value))  # first bound >= value
        self.counts[i] += times

    def frozen(self) -> Histogram:
        return Histogram(BUCKETS_INF, tuple(np.cumsum(self.counts).tolist()))


@dataclass
class _RtRequest:
    arrived: float
    reply: int
    first_token_at: float | None = None
    done_at: float | None = None
    tokens: int = 0


@dataclass
class RtLoad:
    """Real-time arrivals: ``(start, end, rate per second)`` phases, replies of 50-500 tokens."""

    phases: Sequence[tuple[float, float, float]]
    min_reply: int = 50
    max_reply: int = 500
    seed: int = 0

    def arrivals(self) -> list[tuple[float, int]]:
        rng = np.random.default_rng(self.seed)
        out = []
        for start, end, rate in self.phases:
            t = start
            while rate > 0:
                t += float(rng.exponential(1 / rate))
                if t >= end:
                    break
                out.append((t, int(rng.integers(self.min_reply, self.max_reply + 1))))
        return out


class SimServer:
    """The ``Engine`` interface of a real-time server shared with the batch lane (see the module
    docstring); ``snapshot`` is what its ``/metrics`` would say. Times are seconds after
    ``clock``'s start."""

    block_size = 16

    def __init__(
        self,
        clock: VirtualClock,
        step_model: StepModel,
        load: RtLoad,
        max_num_seqs: int = 256,
        max_model_len: int = 4096,
    ) -> None:
        self.model_name = MODEL
        self.max_model_len = max_model_len
        #: Its tokens are bytes.
        self.vocab_size = 256
        self.max_num_seqs = max_num_seqs
        self.capabilities = EngineCapabilities(max_num_seqs=max_num_seqs, block_size=16)
        self.server_meter = None
        self.clock, self.step_model = clock, step_model
        self.origin = clock.time()
        # Absolute clock times: ``origin + a - origin`` need not round back to ``a``.
        self._rt_arrivals = deque((self.origin + at, reply) for at, reply in load.arrivals())
        self.rt_done: list[_RtRequest] = []
        self._rt_waiting: deque[_RtRequest] = deque()
        self._rt_running: list[_RtRequest] = []
        self._batch_waiting: deque[EngineRequest] = deque()
        self._batch_running: dict[str, EngineRequest] = {}
        #: Batch requests not yet given a first token, and when they were added.
        self._batch_added: dict[str, float] = {}
        self._finish: list[tuple[int, str]] = []
        self.steps = 0
        self.itl, self.ttft = _Hist(), _Hist()
        #: (time after the start, batch tokens) per step, for tokens/s per phase.
        self.batch_tokens: list[tuple[float, int]] = []

    # Engine interface (batch lines) ----------------------------------------------------------

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return list("".join(str(m.get("content")) for m in messages).encode())

    def encode_text(self, text: str) -> list[int]:
        return list(text.encode())

    def add(self, request: EngineRequest) -> None:
        self._batch_waiting.append(request)
        self._batch_added[request.request_id] = self.clock.time()

    def abort(self, request_ids: list[str]) -> None:
        doomed = set(request_ids)
        for rid in doomed:
            self._batch_running.pop(rid, None)
            self._batch_added.pop(rid, None)
        self._batch_waiting = deque(r for r in self._batch_waiting if r.request_id not in doomed)

    def num_unfinished(self) -> int:
        return len(self._batch_running) + len(self._batch_waiting)

    def close(self) -> None:
        self._batch_waiting.clear()
        self._batch_running.clear()

    def step(self) -> list[EngineResult]:
        """One server step; the real-time traffic that arrived meanwhile is served first. When
        neither side has work, real-time arrivals are served until the batch lane's next look
        (the runner's loop only steps when it has lines in flight)."""
        self._admit()
        if not self._batch_running and not self._rt_running:
            return []
        return self._one_step()

    def idle_until(self, until: float) -> None:
        """Serve real-time traffic alone until clock time ``until`` (the runner was sleeping)."""
        while True:
            self._admit()
            if self._rt_running:
                if self.clock.time() >= until:
                    return
                self._one_step()
                continue
            nxt = self._rt_arrivals[0][0] if self._rt_arrivals else math.inf
            if nxt >= until:
                self.clock.now = max(self.clock.now, until)
                return
            self.clock.now = max(self.clock.now, nxt)

    def _admit(self) -> None:
        while self._rt_arrivals and self._rt_arrivals[0][0] <= self.clock.time():
            at, reply = self._rt_arrivals.popleft()
            self._rt_waiting.append(_RtRequest(at - self.origin, reply))
        # Priority scheduling: real-time first; vLLM does not preempt running batch sequences
        # for them when max_num_seqs is the limit (vllm-project/vllm#40004), nor does this.
        while self._rt_waiting and self._running() < self.max_num_seqs:
            self._rt_running.append(self._rt_waiting.popleft())
        while self._batch_waiting and self._running() < self.max_num_seqs:
            request = self._batch_waiting.popleft()
            self._batch_running[request.request_id] = request
            heapq.heappush(
                self._finish, (self.steps + max(1, request.sampling.max_tokens), request.request_id)
            )

    def _running(self) -> int:
        return len(self._rt_running) + len(self._batch_running)

    def _one_step(self) -> list[EngineResult]:
        running = self._running()
        cost = self.step_model.step_seconds(running)
        self.clock.advance(cost)
        self.steps += 1
        now = self.clock.time() - self.origin
        self.itl.observe(cost, running)
        self.batch_tokens.append((now, len(self._batch_running)))
        for rid in [r for r in self._batch_added if r in self._batch_running]:
            # A real server's TTFT histogram counts every request's, batch lines' too.
            self.ttft.observe(self.clock.time() - self._batch_added.pop(rid))
        still = []
        for r in self._rt_running:
            r.tokens += 1
            if r.first_token_at is None:
                r.first_token_at = now
                self.ttft.observe(now - r.arrived)
            if r.tokens >= r.reply:
                r.done_at = now
                self.rt_done.append(r)
            else:
                still.append(r)
        self._rt_running = still
        results = []
        while self._finish and self._finish[0][0] <= self.steps:
            _, rid = heapq.heappop(self._finish)
            request = self._batch_running.pop(rid, None)
            if request is None:
                continue
            tokens = [0] * request.sampling.max_tokens
            completions = [Completion("", tokens, "length")] * request.sampling.n
            results.append(EngineResult(rid, len(request.prompt_token_ids), 0, completions))
        return results

    def snapshot(self) -> ServerSnapshot:
        self._admit()
        return ServerSnapshot(
            self.clock.monotonic(),
            self.itl.frozen(),
            self.ttft.frozen(),
            float(self._running()),
            float(len(self._rt_waiting)),
        )


class _SimMetrics:
    def __init__(self, server: SimServer) -> None:
        self.server = server

    def read(self) -> ServerSnapshot:
        return self.server.snapshot()


class _ServingClock(VirtualClock):
    """A virtual clock whose sleeps let the simulated server go on serving real-time traffic."""

    server: SimServer | None = None

    def sleep(self, seconds: float) -> None:
        if self.server is None or seconds <= 0:
            super().sleep(seconds)
        else:
            self.server.idle_until(self.now + seconds)


@dataclass(frozen=True)
class ColocateParams:
    base_ms: float = 10.0
    per_seq_ms: float = 0.4
    max_num_seqs: int = 256
    #: Seconds of each phase: quiet, busy, quiet.
    phase_seconds: float = 300.0
    #: Real-time rates as fractions of the server's real-time capacity at the TPOT floor.
    quiet: float = 0.2
    busy: float = 0.8
    #: Batch lines offered (more than can be served: the lane always has work).
    batch_lines: int = 20_000
    batch_reply: int = 256
    seed: int = 0


@dataclass
class PhaseResult:
    name: str
    rate_per_s: float
    served: int
    ttft_p50: float | None
    ttft_p95: float | None
    tpot_p50: float | None
    tpot_p95: float | None
    tpot_p99: float | None
    batch_tokens_per_s: float
    bound_tokens_per_s: float


@dataclass
class LegResult:
    leg: str
    phases: list[PhaseResult] = field(default_factory=list)


def floor_target_seconds(step_model: StepModel, ratio: float) -> float:
    """The default TPOT target: ``ratio ×`` one sequence's step (``LaneSettings.tpot_ratio``)."""
    return ratio * step_model.step_seconds(1)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def run_leg(leg: str, params: ColocateParams, lane: LaneSettings | None = None) -> LegResult:
    """One leg: ``"a"`` real-time alone, ``"b"`` lane off, ``"c"`` the lane (``lane`` or the
    defaults)."""
    from workers.runner import Runner

    step_model = StepModel(params.base_ms, params.per_seq_ms)
    lane = lane or LaneSettings()
    target = floor_target_seconds(step_model, lane.tpot_ratio)
    mean_reply = (50 + 500) / 2
    capacity = realtime_capacity(step_model, target, mean_reply)
    names = ("quiet", "busy", "quiet again")
    fractions = (params.quiet, params.busy, params.quiet)
    p = params.phase_seconds
    phases = [(i * p, (i + 1) * p, f * capacity) for i, f in enumerate(fractions)]
    clock = _ServingClock(DAY_START)
    server = SimServer(
        clock, step_model, RtLoad(phases, seed=params.seed), max_num_seqs=params.max_num_seqs
    )
    clock.server = server
    horizon = 3 * p
    if leg == "a":
        server.idle_until(DAY_START + horizon)
    else:
        rng = np.random.default_rng(params.seed + 1)
        prompts = rng.integers(0, 30_000, (params.batch_lines, 32)).tolist()
        arrival = Arrival(0.0, [(pr, params.batch_reply) for pr in prompts])
        # A window no phase comes near: the lane, not the deadline guard, is measured.
        store = MemoryStore(clock, [arrival], WINDOW, DAY_START)
        enabled = leg == "c"
        policy = SchedulerSettings(lane=lane.model_copy(update={"enabled": enabled}))
        settings = Settings(
            models={MODEL: ModelConfig(engine="instant", max_num_seqs=params.max_num_seqs)},
            allowed_completion_windows=[WINDOW],
            scheduler=policy,
        )
        runner = Runner(
            settings,
            server,  # type: ignore[arg-type]  # SimServer implements the Engine protocol
            "simulated-worker",
            device="simulated",
            store=store,
            clock=clock,
            step_model=step_model,
            export_metrics=False,
            lane_metrics=_SimMetrics(server),
        )
        quiet = logging.getLogger("workers")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            runner.run(until=lambda: clock.time() >= DAY_START + horizon)
        finally:
            quiet.setLevel(level)
    result = LegResult(leg)
    steps = np.array(server.batch_tokens) if server.batch_tokens else np.zeros((0, 2))
    for name, (start, end, rate) in zip(names, phases, strict=True):
        done = [r for r in server.rt_done if start <= r.arrived < end]
        ttft = [r.first_token_at - r.arrived for r in done if r.first_token_at is not None]
        tpot = [
            (r.done_at - r.first_token_at) / (r.tokens - 1)
            for r in done
            if r.done_at is not None and r.first_token_at is not None and r.tokens > 1
        ]
        tokens = 0.0
        if len(steps):
            inside = (steps[:, 0] >= start) & (steps[:, 0] < end)
            tokens = float(steps[inside, 1].sum())
        # Little's law: real-time sequences running on average at this rate and the target.
        rt_running = rate * mean_reply * target
        result.phases.append(
            PhaseResult(
                name, rate, len(done), _pct(ttft, 50), _pct(ttft, 95), _pct(tpot, 50),
                _pct(tpot, 95), _pct(tpot, 99), tokens / (end - start),
                bound_tokens_per_s(step_model, target, rt_running),
            )
        )  # fmt: skip
    return result


def simulate_colocate(
    params: ColocateParams | None = None, lane: LaneSettings | None = None
) -> dict[str, Any]:
    """Legs a, b and c on the same arrivals; a JSON-ready summary with the TPOT target and the
    harvest (batch tokens/s in c over the bound) per phase."""
    params = params or ColocateParams()
    lane = lane or LaneSettings()
    step_model = StepModel(params.base_ms, params.per_seq_ms)
    target = floor_target_seconds(step_model, lane.tpot_ratio)
    legs = {leg: run_leg(leg, params, lane) for leg in ("a", "b", "c")}
    summary: dict[str, Any] = {
        "params": params.__dict__,
        "tpot_target_s": target,
        "floor_batch": largest_batch(step_model, 1.0 / target),
        "legs": {k: [ph.__dict__ for ph in v.phases] for k, v in legs.items()},
    }
    summary["harvest"] = [
        c.batch_tokens_per_s / c.bound_tokens_per_s if c.bound_tokens_per_s else None
        for c in legs["c"].phases
    ]
    return summary
