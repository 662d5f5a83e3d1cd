"""The batch lane's controller: how many batch requests are in flight at a shared real-time server.

When batch lines run *through* the real-time vLLM server (a remote engine), every running sequence
shares the server's decode steps, so each batch line in flight slows every real-time user a
little. The lane keeps the real-time users inside three targets, read every ``control_seconds``
from the server's ``/metrics`` (``workers.lane.scraper``):

- **TPOT p95**: the windowed inter-token latency. Every running sequence gets one token per step,
  so the server's inter-token latency is the real-time users' too.
- **TTFT p95**: the windowed time to first token, less the first tokens of the batch lines sent
  in the window, taken out as the slowest (batch lines rank below real-time ones and carry the
  longer prompts): the real-time users' TTFT.
- **real-time waiting**: the lane never puts more lines in flight than the server has free
  sequence slots, so what waits there is real-time work.

A window runs over the last ``window_seconds`` but never across the last change of the limit, so
a decision is judged on what followed it.

The targets default to ``ratio × baseline``; the default ratio, 2.4, is how far a per-user speed
floor of 40 tokens/s lets a user's step grow on the default step model (``docs/planning.md``). The
baseline is the real-time latency with no batch work, measured by the controller over the first
``learn_seconds`` with the lane empty (only then: an empty lane later would measure the real-time
load instead). Until TPOT is measured the step model's ``step_ms(1)`` stands in; until TTFT is, TTFT
is not judged. ``LaneSettings`` may set baselines or targets outright.

The decision (``LaneController.update``) is TCP's: after ``learn_seconds`` the lane starts at one
line and grows ×1.5 per interval while every reading is below ``(1 - hold_band) ×`` its target and
the lane uses its limit, up to a slow-start threshold (the step model's answer until a breach,
then the limit the breach left), ``+additive_increase`` beyond it; it holds inside the band and
multiplies by ``decrease_factor`` on a breach: a target exceeded, or real-time requests waiting
at two readings in a row (the runner sends the newest batch lines above the new limit back to
pending). Urgent batches keep ``urgent_min`` lines in flight whatever the readings. An unreadable
server holds the limit for ``stale_seconds``, then drops it to the urgent minimum.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from offpeak.lane_settings import LaneSettings
from workers.planner import StepModel, largest_batch
from workers.vllm_metrics import Histogram, ServerSnapshot

# --- The decision ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaneDecision:
    """One control interval's decision: the new ``limit`` (batch requests in flight), why, and
    the readings it was taken on (seconds; ``None`` when not measured)."""

    limit: int
    previous: int
    action: str  # start | increase | hold | decrease | unreadable | learning | off
    reason: str
    in_flight: int
    realtime_running: int
    waiting: float
    tpot_p95: float | None
    ttft_p95: float | None
    tpot_target: float | None
    ttft_target: float | None
    #: The windowed p95 of finished requests' own TPOT and its target (``None``: not measured).
    request_tpot_p95: float | None = None
    request_tpot_target: float | None = None

    def explain(self) -> str:
        def ms(x: float | None) -> str:
            return "n/a" if x is None else f"{1000 * x:.0f} ms"

        return (
            f"lane {self.previous} -> {self.limit} ({self.action}: {self.reason}); "
            f"TPOT p95 {ms(self.tpot_p95)} / target {ms(self.tpot_target)}, request TPOT p95 "
            f"{ms(self.request_tpot_p95)} / target {ms(self.request_tpot_target)}, TTFT p95 "
            f"{ms(self.ttft_p95)} / target {ms(self.ttft_target)}, real-time running "
            f"{self.realtime_running}, waiting {self.waiting:g}, batch in flight {self.in_flight}"
        )


@dataclass
class _Baseline:
    """Histogram observations gathered while the lane had nothing in flight."""

    tpot: Histogram | None = None
    ttft: Histogram | None = None
    request_tpot: Histogram | None = None

    def add(self, name: str, delta: Histogram | None) -> None:
        if delta is None or delta.count <= 0:
            return
        old = getattr(self, name)
        if old is None or old.bounds != delta.bounds:
            setattr(self, name, delta)
        else:
            setattr(self, name, old.plus(delta))


@dataclass
class LaneController:
    """The AIMD controller of the module docstring. Pure: ``update`` takes a snapshot (or
    ``None``: unreadable), the batch lines in flight and whether urgent lines are held, at
    monotonic time ``at``; no I/O, so tests and the simulation drive it with made-up readings."""

    settings: LaneSettings
    max_num_seqs: int
    step_model: StepModel = field(default_factory=StepModel)
    limit: int = 0
    started_at: float | None = None
    _history: deque[ServerSnapshot] = field(default_factory=deque)
    #: Batch lines the runner had sent when each snapshot of ``_history`` was taken.
    _sent: deque[int] = field(default_factory=deque)
    _changed_at: float = -math.inf
    _started: bool = False
    _last_read_at: float | None = None
    _last_empty: ServerSnapshot | None = None
    _baseline: _Baseline = field(default_factory=_Baseline)
    #: Slow-start threshold (TCP's ``ssthresh``): ×1.5 growth below it, ``+additive_increase``
    #: above. ``None``: the step model's answer. A breach sets it to the decreased limit; it
    #: goes back to the model's answer once the real-time sequences running have halved (and
    #: fallen by at least 4) since that breach, e.g. from a busy spell to a quiet one.
    _threshold: int | None = None
    _breach_realtime: int = 0
    #: Real-time requests waiting at the previous reading (a breach needs two in a row).
    _waiting_before: float = 0.0

    # Targets ----------------------------------------------------------------------------------

    def baseline_tpot(self) -> float:
        """Seconds: the set baseline, else the p95 measured with the lane empty (once it has
        ``min_tokens`` observations), else the step model's one-sequence step."""
        s = self.settings
        if s.baseline_tpot_ms is not None:
            return s.baseline_tpot_ms / 1000
        h = self._baseline.tpot
        if h is not None and h.count >= s.min_tokens:
            value = self._tpot_of(h)
            if value:
                return value
        return self.step_model.step_ms(1) / 1000

    def _tpot_of(self, h: Histogram) -> float | None:
        """A window's TPOT reading: the mean inter-token latency (a request's TPOT is the mean
        of its gaps, while the p95 of single gaps is the prefill stalls'); ``p95`` on request."""
        if self.settings.tpot_statistic == "p95":
            return h.quantile(0.95)
        return h.mean if h.total > 0 else h.quantile(0.5)

    def baseline_ttft(self) -> float | None:
        s = self.settings
        if s.baseline_ttft_ms is not None:
            return s.baseline_ttft_ms / 1000
        h = self._baseline.ttft
        if h is not None and h.count >= s.min_requests:
            return h.quantile(0.95)
        return None

    def baseline_request_tpot(self) -> float | None:
        """Seconds: the p95 of finished requests' own TPOT with the lane empty, once
        ``min_requests`` finished; ``None`` before (or with the signal off)."""
        h = self._baseline.request_tpot
        if not self.settings.request_tpot or h is None or h.count < self.settings.min_requests:
            return None
        return h.quantile(0.95)

    def request_tpot_target(self) -> float | None:
        """The users' own TPOT p95 target: ``tpot_p95_ms`` when set, else ``tpot_ratio ×`` its
        baseline; ``None`` until that is measured."""
        s = self.settings
        if not s.request_tpot:
            return None
        if s.tpot_p95_ms is not None:
            return s.tpot_p95_ms / 1000
        base = self.baseline_request_tpot()
        return None if base is None else s.tpot_ratio * base

    def tpot_target(self) -> float:
        s = self.settings
        if s.tpot_p95_ms is not None:
            return s.tpot_p95_ms / 1000
        return s.tpot_ratio * self.baseline_tpot()

    def ttft_target(self) -> float | None:
        s = self.settings
        if s.ttft_p95_ms is not None:
            return s.ttft_p95_ms / 1000
        base = self.baseline_ttft()
        return None if base is None else s.ttft_ratio * base

    def model_limit(self, realtime_running: int) -> int:
        """The step model's answer: the largest batch whose step stays within the TPOT target (the
        largest batch at the floor, ``docs/planning.md``), minus the real-time sequences running."""
        floor = 1.0 / self.tpot_target()
        total = largest_batch(self.step_model, floor, memory_limit=self.max_num_seqs)
        return max(0, total - realtime_running)

    # Decision ---------------------------------------------------------------------------------

    def _window_start(self, at: float) -> tuple[ServerSnapshot, int] | None:
        """The snapshot the window starts at: the oldest within ``window_seconds`` and not
        before the last change; when readings are further apart than the window (a runner
        that slept), the one before the latest, unless the limit changed after it."""
        since = max(at - self.settings.window_seconds, self._changed_at)
        pairs = list(zip(self._history, self._sent, strict=True))
        for snap, sent in pairs[:-1]:
            if snap.at >= since - 1e-9:
                return snap, sent
        if len(pairs) >= 2 and pairs[-2][0].at >= self._changed_at - 1e-9:
            return pairs[-2]
        return None

    def update(
        self,
        at: float,
        snapshot: ServerSnapshot | None,
        in_flight: int,
        urgent: bool,
        sent: int | None = None,
    ) -> LaneDecision:
        """The limit for the next interval (see the module docstring). ``sent``: batch lines
        sent to the server so far (a running count); their first tokens are in the server's
        TTFT histogram too, and are taken out of the window's p95 as its slowest (batch lines
        rank below real-time ones and carry the longer prompts), so TTFT is the real-time
        users'. ``None``: nothing is taken out."""
        s = self.settings
        previous = self.limit
        if self.started_at is None:
            self.started_at = at
        floor = s.urgent_min if urgent else 0
        if snapshot is None:
            stale = self._last_read_at is None or at - self._last_read_at > s.stale_seconds
            if stale:
                self.limit = floor
            return self._decide(previous, "unreadable", "metrics unreadable", in_flight, 0, 0.0)
        self._last_read_at = at
        if not self._started or not self._baselines_measured():
            # Before the lane starts (or until a baseline had enough traffic to be measured):
            # an empty lane later, after a breach or in a busy spell, would measure the
            # real-time load, not the speed without batch work.
            self._learn(snapshot, in_flight)
        self._history.append(snapshot)
        self._sent.append(sent or 0)
        while len(self._history) > 2 and self._history[0].at < at - 2 * s.window_seconds:
            self._history.popleft()
            self._sent.popleft()
        rt_running = max(0, round(snapshot.running) - in_flight)
        room = max(0, self.max_num_seqs - rt_running)  # never queue batch lines at the server
        window = self._window_start(snapshot.at)
        tpot = ttft = request_tpot = None
        if window is not None:
            start, sent_then = window
            tpot_delta = snapshot.tpot.minus(start.tpot) if snapshot.tpot else None
            if tpot_delta is not None and tpot_delta.count >= s.min_tokens:
                tpot = self._tpot_of(tpot_delta)
            elif (
                tpot_delta is not None
                and tpot_delta.count == 0
                and in_flight > 0
                and snapshot.at - start.at >= s.control_seconds - 1e-9
            ):
                # Lines in flight and not one token for a whole interval: every decode is
                # stalled (prefills of lines that joined at once): as bad as it gets.
                tpot = math.inf
            ttft_delta = snapshot.ttft.minus(start.ttft) if snapshot.ttft else None
            own = max(0, (sent or 0) - sent_then)
            if ttft_delta is not None and ttft_delta.count - own >= s.min_requests:
                ttft = ttft_delta.quantile(0.95, drop_top=own)
            if snapshot.request_tpot is not None:
                rq_delta = snapshot.request_tpot.minus(start.request_tpot)
                if rq_delta.count >= s.min_requests:
                    request_tpot = rq_delta.quantile(0.95)
        tpot_target, ttft_target = self.tpot_target(), self.ttft_target()
        rq_target = self.request_tpot_target()
        if rq_target is None:
            request_tpot = None
        args = (in_flight, rt_running, snapshot.waiting, tpot, ttft, tpot_target, ttft_target,
                request_tpot, rq_target)  # fmt: skip

        if not self._started:
            # The whole of ``learn_seconds``, not just until the minimum counts: a few requests'
            # p95 is noise, and every target is a multiple of it.
            if at - self.started_at < s.learn_seconds:
                self.limit = floor
                return self._decide(previous, "learning", "measuring the baseline", *args)
            self._started = True
            # Slow start from one line: the step model has no prefill term, and a batch line's
            # prefill can cost the real-time users far more than its decode.
            self.limit = max(floor, min(room, 1))
            self._changed_at = snapshot.at
            return self._decide(previous, "start", "slow start after the baseline", *args)

        breaches = []
        waiting_before, self._waiting_before = self._waiting_before, snapshot.waiting
        if snapshot.waiting > s.max_waiting and waiting_before > s.max_waiting:
            # Two readings in a row: one request caught between its arrival and the next step
            # is not queueing.
            breaches.append(f"{snapshot.waiting:g} real-time requests waiting")
        if tpot is not None and tpot > tpot_target:
            breaches.append("TPOT p95 above target")
        if ttft is not None and ttft_target is not None and ttft > ttft_target:
            breaches.append("TTFT p95 above target")
        if request_tpot is not None and rq_target is not None and request_tpot > rq_target:
            # The window's mean step can sit at its target while the requests' own TPOT p95
            # is above theirs.
            breaches.append("request TPOT p95 above target")
        if breaches:
            self.limit = max(floor, min(math.floor(self.limit * s.decrease_factor), room))
            self._threshold, self._breach_realtime = max(1, self.limit), rt_running
            if self.limit != previous:
                self._changed_at = snapshot.at
            return self._decide(previous, "decrease", "; ".join(breaches), *args)
        below = 1.0 - s.hold_band
        # Nothing running or waiting and no line of ours: no token to measure and no one to
        # protect (a replica without real-time traffic); the lane may start again.
        idle = in_flight == 0 and round(snapshot.running) == 0 and snapshot.waiting == 0
        inside = (
            tpot is not None
            and tpot <= below * tpot_target
            and (ttft is None or ttft_target is None or ttft <= below * ttft_target)
            and (request_tpot is None or rq_target is None or request_tpot <= below * rq_target)
        ) or (idle and tpot is None)
        if self.limit > room:
            self.limit = max(floor, room)
            self._changed_at = snapshot.at
            return self._decide(previous, "decrease", "real-time took the free slots", *args)
        if inside and in_flight >= self.limit and self.limit < room:
            self.limit = min(room, self._grown(rt_running))
            self._changed_at = snapshot.at
            return self._decide(previous, "increase", "inside targets", *args)
        self.limit = max(self.limit, floor)
        reason = (
            "too few samples"
            if tpot is None and not inside
            else "lane not using its limit"
            if inside
            else "inside the hold band"
        )
        return self._decide(previous, "hold", reason, *args)

    def _baselines_measured(self) -> bool:
        s, b = self.settings, self._baseline
        tpot = s.baseline_tpot_ms is not None or (
            b.tpot is not None and b.tpot.count >= s.min_tokens
        )
        ttft = s.baseline_ttft_ms is not None or (
            b.ttft is not None and b.ttft.count >= s.min_requests
        )
        return tpot and ttft

    def _grown(self, rt_running: int) -> int:
        """The next limit inside the targets: ×1.5 below the slow-start threshold (the step
        model's answer until a breach, then the limit that breach left), ``+additive_increase``
        at or above it: fast to where the model or the last breach says the floor is, slowly
        beyond (TCP's slow start and congestion avoidance)."""
        if self._threshold is not None:
            halved = rt_running < 0.5 * self._breach_realtime
            if halved and self._breach_realtime - rt_running >= 4:
                self._threshold = None  # a different real-time load: the model's answer again
        threshold = self._threshold if self._threshold is not None else self.model_limit(rt_running)
        step = self.limit + self.settings.additive_increase
        if self.limit < threshold:
            return max(step, min(threshold, math.ceil(self.limit * 1.5)))
        return step

    def _learn(self, snapshot: ServerSnapshot, in_flight: int) -> None:
        """Add the interval since the last empty-lane snapshot to the baseline when the lane
        was empty at both ends."""
        if in_flight > 0:
            self._last_empty = None
            return
        if self._last_empty is not None:
            if snapshot.tpot is not None:
                self._baseline.add("tpot", snapshot.tpot.minus(self._last_empty.tpot))
            if snapshot.ttft is not None:
                self._baseline.add("ttft", snapshot.ttft.minus(self._last_empty.ttft))
            if snapshot.request_tpot is not None:
                self._baseline.add(
                    "request_tpot", snapshot.request_tpot.minus(self._last_empty.request_tpot)
                )
        self._last_empty = snapshot

    def _decide(
        self,
        previous: int,
        action: str,
        reason: str,
        in_flight: int,
        rt_running: int,
        waiting: float,
        tpot: float | None = None,
        ttft: float | None = None,
        tpot_target: float | None = None,
        ttft_target: float | None = None,
        request_tpot: float | None = None,
        request_tpot_target: float | None = None,
    ) -> LaneDecision:
        return LaneDecision(
            self.limit, previous, action, reason, in_flight, rt_running, waiting, tpot, ttft,
            tpot_target, ttft_target, request_tpot, request_tpot_target,
        )  # fmt: skip


def victims(running: Mapping[str, str], keep: int, urgent: Callable[[str], bool]) -> list[str]:
    """Request ids to abort so that ``keep`` stay in flight: newest first (``running`` is in
    admission order, id → batch id), lines of non-urgent batches before urgent ones."""
    excess = len(running) - keep
    if excess <= 0:
        return []
    newest: list[str] = list(reversed(list(running)))
    ordered = [r for r in newest if not urgent(running[r])] + [
        r for r in newest if urgent(running[r])
    ]
    return ordered[:excess]


# --- The bound: what the step model allows ---------------------------------------------------


def realtime_capacity(step_model: StepModel, target: float, mean_reply: float) -> float:
    """Real-time requests per second the server sustains at the TPOT target: the largest batch
    at the floor (``workers.planner.largest_batch``), each request holding a slot for ``mean
    reply × target`` seconds (Little's law)."""
    batch = largest_batch(step_model, 1.0 / target)
    return batch / (mean_reply * target)


def bound_tokens_per_s(step_model: StepModel, target: float, realtime_running: float) -> float:
    """Batch tokens/s the step model allows under the TPOT target beside ``realtime_running``
    real-time sequences: ``(B − rt) / step(B)`` with ``B`` the largest batch at the floor."""
    batch = largest_batch(step_model, 1.0 / target)
    extra = max(0.0, batch - realtime_running)
    return extra / step_model.step_seconds(batch) if extra else 0.0
