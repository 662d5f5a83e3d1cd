"""The runner's loop: load, deadlines, claims, engine steps and write-backs for one model.

Each turn it reads the load (``workers.scheduler.signals``, every ``load_poll_seconds``) into
the hysteresis gate, refreshes the batches' slack (``workers.scheduler.slack``, every
``estimate_seconds``), tops the engine up and steps it once.

- **Claims** come in chunks sized from the engine's room (``workers.scheduler.chunking``): the
  runner holds ``slots × queue_depth`` lines, ``slots`` of them running and the rest queued here
  (``workers.runner.held``), and claims the difference while the engine decodes, across all
  batches of the model, earliest deadline first, with a lease. Each chunk is prepared and
  ordered (``workers.runner.admission``) and the sizing decision is logged before it runs.
- **Yield**: while the gate is closed (load above high-water until it falls to low-water, an
  admin pause, an unreadable signal) nothing new starts; when it closes mid-chunk, queued lines
  go back to pending and, with ``abort_on_yield``, so do running sequences. Urgent batches
  (slack below their margin) are exempt: they are claimed, admitted and kept whatever the load;
  a hard pause stops them too.
- **Write-back** every ``flush_seconds`` (``workers.runner.write_back``): results, the engine
  time they took, a lease heartbeat, and the batches' statuses, which stop the lines of
  cancelled or expired batches. A database outage only delays it.
- **Faults**: an engine that fails raises ``EngineFault`` after every held line went back to
  pending; a stop request (``workers.lifecycle``) hands everything back and returns.

Time comes from an injectable clock and lines from an injectable store, so ``offpeak simulate
day`` drives this same code on a virtual clock.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from offpeak.ids import now as unix_now
from offpeak.settings import Settings
from offpeak.statuses import BatchStatus, LineStatus
from storage.errors import TRANSIENT_DB_ERRORS
from storage.repositories.requests import ClaimedRequest
from workers import lifecycle, worker_metrics
from workers.engine.base import Engine, EngineFault
from workers.engine.release import startup_seconds
from workers.engine_io import LineError
from workers.planner import StepModel
from workers.runner import results
from workers.runner.admission import PreparedChunk, prepare_chunk
from workers.runner.claim_ahead import ClaimAhead
from workers.runner.held import HeldLine, HeldLines
from workers.runner.write_back import ResultWriter
from workers.scheduler import scheduler_metrics as metrics
from workers.scheduler.chunking import claim_size, engine_room, size_for
from workers.scheduler.clock import Clock, WallClock
from workers.scheduler.hysteresis import Gate
from workers.scheduler.lane import LaneController, LaneDecision, victims
from workers.scheduler.lane_scraper import PrometheusServer, ServerMetrics, metrics_url
from workers.scheduler.lease_heartbeat import LeaseHeartbeat
from workers.scheduler.signals import BackgroundMonitor, LoadMonitor, build_signals
from workers.scheduler.slack import Estimate, calibrated, refresh_estimates
from workers.scheduler.store import DbStore, WorkStore

log = logging.getLogger(__name__)

#: Seconds of engine stepping over which the runner's own tokens/s is averaged, and the least
#: it must have stepped before that rate is trusted.
RATE_SECONDS = 300.0
RATE_TRUSTED_AFTER = 30.0
#: Finished lines held and not yet sent to a write, past which the write-back waits for room
#: among the writes in flight (``writeback.MAX_IN_FLIGHT``) and then starts the next in the
#: background rather than let them pile up: an engine that answers faster than the database
#: stores (the instant engine, embeddings) would otherwise hold a growing backlog of records
#: while the background writes lag. So at most this plus a step's answers are held for each
#: write in flight and for the next, whatever the batch's size
#: (``test_the_runner_holds_no_more_for_ten_times_the_inputs``,
#: ``test_the_runner_holds_a_bounded_number_of_unstored_results_while_writes_lag``). A GPU's
#: second of answers (hundreds of lines) mostly stays under it.
MAX_PENDING_LINES = 512
#: ``results.held_bytes`` of the finished lines held (the writes in flight's included) past
#: which the write-back waits for every write in flight before it starts the next: heavy lines
#: (embeddings' vectors, long completions) keep one write in flight and at most this plus a
#: step's answers in memory, while light ones (short chat answers: a few hundred bytes) get
#: ``writeback.MAX_IN_FLIGHT`` writes of ``MAX_PENDING_LINES`` each. 1 MiB: 2,400 bench
#: control lines (≈ 430 bytes each), 600 lines of 384-dimension embeddings.
MAX_HELD_BYTES = 1 << 20
#: Seconds a stopping runner leaves before its stop's deadline for the engine to close and the
#: process to exit, when it keeps retrying a write-back (``Runner._hand_back_all``).
STOP_MARGIN_SECONDS = 5.0


@dataclass
class DrainStats:
    """What one ``Runner.run`` did."""

    #: Claims that returned lines.
    chunks: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    #: Wall (or virtual) seconds of the run, and of them the seconds spent in ``engine.step``.
    seconds: float = 0.0
    busy_seconds: float = 0.0
    yields: int = 0
    #: Running sequences aborted on a yield, and queued lines handed back unrun.
    aborted: int = 0
    released: int = 0
    #: ``drained`` (nothing runnable left), ``yielded`` (load or a pause stopped it with work
    #: left) or ``stopped`` (the caller's ``until``, or the worker shutting down: its lines went
    #: back to pending).
    outcome: str = ""
    touched: set[str] = field(default_factory=set)

    @property
    def prefix_hit_rate(self) -> float:
        """``cached_tokens / prompt_tokens`` of the requests that finished."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def count(self, requests: int, prompt: int, cached: int, completion: int) -> None:
        """Add ``requests`` answered lines and their tokens."""
        self.requests += requests
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.completion_tokens += completion


@dataclass
class Claimed:
    """A claim's rows and the chunk prepared from them (``workers.runner.admission``), or the
    ``fault`` that stopped preparing them (the engine could not tokenize: no line's fault)."""

    rows: list[ClaimedRequest]
    chunk: PreparedChunk | None = None
    fault: EngineFault | None = None


class Runner:
    """Runs one model's batch work on ``engine`` under the scheduler's policy.

    One runner per model per process, kept between drain tasks so the gate's hysteresis and the
    urgent set survive. ``on_batch_touched(batch_id)`` is called for every batch whose lines it
    finished or stopped (the caller sends their finalize). ``store``, ``clock`` and ``monitor``
    default to the database, the wall clock and the pool's configured signals.
    """

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        owner: str,
        on_batch_touched: Callable[[str], None] | None = None,
        device: str = "cpu",
        *,
        store: WorkStore | None = None,
        clock: Clock | None = None,
        monitor: LoadMonitor | None = None,
        step_model: StepModel | None = None,
        export_metrics: bool = True,
        lane_metrics: ServerMetrics | None = None,
    ) -> None:
        self.settings = settings
        #: Update this process's Prometheus metrics (off in the simulation: not this process's).
        self.export_metrics = export_metrics
        self.policy = settings.scheduler
        self.engine = engine
        self.model = engine.model_name
        self.owner = owner
        self.on_batch_touched = on_batch_touched or (lambda _batch_id: None)
        self.device = device
        self.store: WorkStore = store or DbStore(settings.resolved_database_url)
        self.clock: Clock = clock or WallClock()
        self.monitor: LoadMonitor | BackgroundMonitor = monitor or LoadMonitor(
            build_signals(self.policy), pause=lambda: self.store.pause_state(self.policy.pool)
        )
        if monitor is None and isinstance(self.clock, WallClock):
            # Read off the loop: a slow metrics endpoint must not stall the engine's steps.
            self.monitor = BackgroundMonitor(
                self.monitor,
                self.policy.load_poll_seconds,
                stale_after=3 * self.policy.load_poll_seconds
                + self.policy.prometheus.timeout_seconds,
            )
        self.gate = Gate(self.policy.low_water, self.policy.high_water, self.policy.on_signal_error)
        self.room = engine_room(engine, settings.models.get(self.model))
        self.slots = self.room.max_num_seqs
        #: Fallback throughput before any is measured: the calibrated or the seed's step model.
        self.step_model = step_model or calibrated(settings, self.model, device)
        self.held = HeldLines()
        #: The batch lane (``workers.scheduler.lane``): batch requests in flight at a shared
        #: real-time server, steered by its latencies; ``None`` when off.
        self.lane: LaneController | None = None
        self.lane_metrics = lane_metrics
        self._sized_slots = self.slots
        self._next_lane_at = -math.inf
        #: The lane's recent decisions, oldest first (the simulation and the bench read them).
        self.lane_decisions: deque[LaneDecision] = deque(maxlen=10_000)
        #: Lines added to the engine so far (the lane takes their first tokens out of TTFT).
        self.lines_sent = 0
        self._setup_lane()
        self.writer = ResultWriter(
            settings, self.store, owner, self.model, device, self.clock.time(), export_metrics
        )
        # A remote engine's server is shared: its time is charged by our share of its tokens.
        self.writer.share_server(getattr(engine, "server_meter", None))
        self._urgent: set[str] = set()
        #: Every batch that has been urgent in this process (the simulation reports it).
        self.urgent_seen: set[str] = set()
        self.estimates: dict[str, Estimate] = {}
        self._next_load_at = -math.inf
        self._next_estimate_at = -math.inf
        self._next_claim_at = -math.inf
        self._last_flush = self.clock.monotonic()
        #: Tokens generated and seconds stepped, decayed over ``RATE_SECONDS`` of stepping.
        self._rate_tokens = self._rate_seconds = 0.0
        self._published_at = -math.inf
        self._chunk_prompt = self._chunk_cached = 0
        #: Whether the last step finished every line it ran (``_claim_limit``).
        self._empties = False
        #: This process's totals, for the prefix-cache hit rate in logs and metrics.
        self.lifetime = DrainStats()
        self._stats = DrainStats()
        #: Renews the leases between write-backs (a long step); off in the simulation.
        self.heartbeat: LeaseHeartbeat | None = (
            LeaseHeartbeat(self._renew, settings.lease_seconds)
            if isinstance(self.clock, WallClock)
            else None
        )
        #: Claims on a thread while the engine steps; off in the simulation (virtual clock) and
        #: with the batch lane, which sends lines to a shared server to an exact limit.
        self.claim_ahead: ClaimAhead[Claimed] | None = (
            ClaimAhead() if isinstance(self.clock, WallClock) and self.lane is None else None
        )

    def replace_engine(self, engine: Engine) -> None:
        """Drive ``engine`` from now on (a new one after the old failed). Only between runs: the
        old engine's lines were handed back when it failed."""
        assert not self.held, "replace_engine while holding lines"
        self.engine = engine
        self.writer.share_server(getattr(engine, "server_meter", None))
        self.room = engine_room(engine, self.settings.models.get(self.model))
        self.slots = self._sized_slots = self.room.max_num_seqs
        if self.lane is not None:
            self.lane.max_num_seqs = self.room.max_num_seqs
            self.slots = min(self.slots, self.lane.limit)

    def _setup_lane(self) -> None:
        """Turn the lane on for a remote engine (``LaneSettings.enabled`` None) or when enabled."""
        lane = self.policy.lane
        config = self.settings.models.get(self.model)
        remote = getattr(config, "engine", None) == "remote"
        if not (lane.enabled if lane.enabled is not None else remote):
            return
        self.lane = LaneController(lane, self.room.max_num_seqs, self.step_model)
        self.slots = 0
        if self.lane_metrics is None:
            url = metrics_url(lane, getattr(config, "url", None), self.policy.prometheus.url)
            self.lane_metrics = PrometheusServer(
                url, lane.control_seconds, lane.timeout_seconds, lane.stale_seconds
            )

    # --- The loop -----------------------------------------------------------------------------

    def drain(self) -> DrainStats:
        """Run until nothing admissible is left: the model's work is done, or the gate is
        closed and no urgent line is runnable (the sweep sends another drain later)."""
        return self.run()

    def run(self, until: Callable[[], bool] | None = None) -> DrainStats:
        """Run the loop. Without ``until`` it returns once the engine is empty and nothing
        admissible can be claimed; with it, it waits (``clock.sleep``) for work or a lower load
        until ``until()`` is true. Unfinished lines go back to pending if it raises
        (``EngineFault`` when the engine failed)."""
        stats = self._stats = DrainStats()
        started = self.clock.monotonic()
        # A new drain acts on a fresh reading, not on the one that ended the last.
        self._next_load_at = self._next_estimate_at = self._next_claim_at = -math.inf
        if isinstance(self.monitor, BackgroundMonitor):
            self.monitor.refresh()
        with self.heartbeat.running() if self.heartbeat else nullcontext():
            try:
                self._loop(until)
            except BaseException as exc:
                # A server that went away (a remote engine) is no line's fault.
                self._give_back(count_attempt=not getattr(exc, "blameless", False))
                raise
        stats.seconds = self.clock.monotonic() - started
        if not stats.outcome:
            stats.outcome = "drained" if self.gate.open else "yielded"
        if stats.requests:
            log.info(
                "%s: %d requests in %d chunks, %d prompt (%.0f%% from the prefix cache) + %d "
                "completion tokens in %.1f s (%.0f tok/s while stepping)",
                self.model,
                stats.requests,
                stats.chunks,
                stats.prompt_tokens,
                100 * stats.prefix_hit_rate,
                stats.completion_tokens,
                stats.seconds,
                stats.completion_tokens / max(stats.busy_seconds, 1e-9),
            )
        for batch_id in stats.touched:
            self.on_batch_touched(batch_id)
        return stats

    def _loop(self, until: Callable[[], bool] | None) -> None:
        looked_again = False
        while True:
            if self.heartbeat:
                self.heartbeat.tick()
            if lifecycle.stop_requested():
                self._hand_back_all()
                self._stats.outcome = "stopped"
                return
            at = self.clock.time()
            self._observe(at)
            self._top_up(at)
            if self.held.running:
                self._step()
                looked_again = False
                heavy = self.writer.held_bytes >= MAX_HELD_BYTES
                backlog = heavy or self.writer.unsent() >= MAX_PENDING_LINES
                if (
                    backlog
                    or self.clock.monotonic() - self._last_flush >= self.settings.flush_seconds
                ):
                    # On the wall clock the periodic write-back overlaps the next steps
                    # (``workers.runner.write_back``); one past the backlog bound first waits
                    # for room among the writes in flight (past the bytes bound, for all of
                    # them), then overlaps them too (the loop waiting for its own write as
                    # well kept the claims and steps idle meanwhile).
                    self._flush(background=self.heartbeat is not None, wait=backlog, settle=heavy)
                continue
            if self._lane_waits() and not (until is not None and until()):
                # The lane has no room at the server yet (learning, or real-time is busy): its
                # lines wait here, leases renewed, rather than go back and be claimed again.
                self.clock.sleep(self.policy.lane.control_seconds)
                continue
            if self._next_claim_at > at and not looked_again:
                # The engine ran dry inside a claim back-off: one more look before idling.
                looked_again, self._next_claim_at = True, -math.inf
                continue
            self._flush()
            if until is None:
                if self.writer.pending:
                    # The write-back failed (database down): the results are the only copy;
                    # keep trying rather than return with them in memory.
                    self.clock.sleep(self.settings.flush_seconds)
                    continue
                break
            if until():
                self._stats.outcome = "stopped"
                break
            self.clock.sleep(self.policy.load_poll_seconds)
        # Lines queued but not admissible (a hard pause) go back rather than wait out a lease.
        self._settle_claim()
        queued = self.held.take_queued(lambda _h: True)
        self.writer.release([h.row for h in queued], count_attempt=False)

    def _step(self) -> None:
        ran = len(self.held.running)
        running = min(ran, self.slots)
        started = self.clock.monotonic()
        try:
            finished = self.engine.step()
        except EngineFault:
            raise  # the engine's own (a remote engine's says whether it is blameless)
        except Exception as exc:
            raise EngineFault(f"engine step failed: {exc!r}", list(self.held.running)) from exc
        elapsed = self.clock.monotonic() - started
        self.writer.busy_seconds += elapsed
        self._stats.busy_seconds += elapsed
        # Every running sequence gains a token per step: the rate counts tokens of lines still
        # running too, which finished-line counts miss right after the engine fills up. A
        # remote engine's step is a poll, not a decode step: it counts the tokens that finished.
        if getattr(self.engine, "step_is_poll", False):
            running = sum(len(c.token_ids) for r in finished for c in r.completions)
        keep = math.exp(-elapsed / RATE_SECONDS)
        self._rate_tokens = self._rate_tokens * keep + running
        self._rate_seconds = self._rate_seconds * keep + elapsed
        # Every line the step ran finished in it (the instant engine, answers of a token or
        # two): the next claim is then all the engine has to run (``_claim_limit``).
        self._empties = bool(finished) and len(finished) >= ran and not self.lane
        # One clock reading for the step's lines (they finished in it), their token counts
        # summed here and added to the totals once a step: per line, this loop runs between two
        # engine steps (at a GPU's step rate, 256 lines every 10-40 ms).
        created, at = unix_now(), self.clock.time()
        requests = prompt = cached = completion = 0
        for result in finished:
            held = self.held.finished(result.request_id)
            if held is None:  # aborted in the same step it finished
                continue
            if result.refused is not None:  # a late verdict (a remote server's 4xx)
                refused = result.refused
                self._refused(held, LineError(str(refused), refused.param, refused.code))
                continue
            # Its record is built when it is written back (off this thread, see ``writeback``).
            line = results.answered(held.row, held.prepared, result, created, at)
            self.writer.add(line)
            tokens = line.tokens
            requests += 1
            prompt += tokens.prompt
            cached += tokens.cached
            completion += tokens.completion
        for stats in (self._stats, self.lifetime):
            stats.count(requests, prompt, cached, completion)
        self._chunk_prompt += prompt
        self._chunk_cached += cached

    # --- Load and deadlines -------------------------------------------------------------------

    def _observe(self, at: float) -> None:
        if at >= self._next_load_at:
            self._next_load_at = at + self.policy.load_poll_seconds
            was_open, was_hard = self.gate.open, self.gate.hard_paused
            reading = self.monitor.read(at)
            self.gate.update(reading)
            if self.export_metrics:
                metrics.observe_gate(self.policy.pool, reading, self.gate)
            changed = was_open != self.gate.open or was_hard != self.gate.hard_paused
            if changed or at - self._published_at >= self.policy.estimate_seconds:
                self._publish(reading.as_json() | {"gate_open": self.gate.open}, at)
            if (was_open and not self.gate.open) or (self.gate.hard_paused and not was_hard):
                self._yield()
        if at >= self._next_estimate_at:
            self._next_estimate_at = at + self.policy.estimate_seconds
            self._estimate(at)
        if self.lane is not None and self.clock.monotonic() >= self._next_lane_at:
            self._next_lane_at = self.clock.monotonic() + self.policy.lane.control_seconds
            self._steer_lane()

    # --- The batch lane -----------------------------------------------------------------------

    def _lane_waits(self) -> bool:
        return (
            self.lane is not None
            and bool(self.held.queued)
            and self.slots == 0
            and not self.gate.hard_paused
            and not lifecycle.stop_requested()
        )

    def _steer_lane(self) -> None:
        """One lane decision: the new limit becomes the engine's slots; running lines above it
        are aborted, newest first (urgent batches' last), and go back to pending."""
        assert self.lane is not None and self.lane_metrics is not None
        urgent = any(h.row.batch_id in self._urgent for h in self.held.all())
        decision = self.lane.update(
            self.clock.monotonic(),
            self.lane_metrics.read(),
            len(self.held.running),
            urgent,
            sent=self.lines_sent,
        )
        self.slots = min(self._sized_slots, decision.limit)
        level = logging.INFO if decision.limit != decision.previous else logging.DEBUG
        log.log(level, "%s: %s", self.model, decision.explain())
        if self.export_metrics:
            metrics.observe_lane(self.model, decision)
            metrics.SLOTS.labels(self.model).set(self.slots)
        self.lane_decisions.append(decision)
        running = {rid: h.row.batch_id for rid, h in self.held.running.items()}
        doomed = set(victims(running, decision.limit, lambda b: b in self._urgent))
        if not doomed:
            return
        taken = self.held.take_running(lambda h: h.request_id in doomed)
        self._abort([h.request_id for h in taken])
        self._flush()  # what finished is written before its neighbours are handed back
        self.writer.release([h.row for h in taken], count_attempt=False)
        self._stats.aborted += len(taken)
        if self.export_metrics:
            metrics.LANE_ABORTED.labels(self.model).inc(len(taken))
        log.info("%s: lane aborted %d running batch lines back to pending", self.model, len(taken))

    def _publish(self, reading: dict[str, Any], at: float) -> None:
        try:
            self.store.publish_load(self.policy.pool, reading | {"worker": self.owner}, at)
            self._published_at = at
        except TRANSIENT_DB_ERRORS as exc:
            log.warning("cannot publish the load reading: %s", exc)

    def _estimate(self, at: float) -> None:
        """Refresh every running batch's estimate; batches whose slack fell below their margin
        join the urgent set (and stay in it until they end, so they do not flap)."""
        try:
            estimates = refresh_estimates(
                self.store,
                self.settings,
                self.model,
                at,
                self.step_model,
                self.slots,
                local_rate=self.measured_tokens_per_second,
                startup_seconds=startup_seconds(self.engine),
            )
        except TRANSIENT_DB_ERRORS as exc:
            log.warning("cannot refresh the slack estimates: %s", exc)
            return
        ended = set(self.estimates) - {e.batch_id for e in estimates}
        self.estimates = {e.batch_id: e for e in estimates}
        self._urgent &= set(self.estimates)
        for e in estimates:
            if e.urgent and e.batch_id not in self._urgent:
                self._urgent.add(e.batch_id)
                self.urgent_seen.add(e.batch_id)
                log.warning(
                    "batch %s is urgent: %d lines (~%.0f tokens) left, slack %.0f s < margin "
                    "%.0f s; it runs whatever the load",
                    e.batch_id,
                    e.remaining_lines,
                    e.remaining_tokens,
                    e.slack_seconds,
                    e.margin_seconds,
                )
        if self.export_metrics:
            metrics.observe_estimates(self.model, estimates, ended)

    @property
    def measured_tokens_per_second(self) -> float | None:
        """Tokens/s this runner's engine generated recently, once it stepped long enough."""
        if self._rate_seconds < RATE_TRUSTED_AFTER:
            return None
        return self._rate_tokens / self._rate_seconds

    def _admissible(self, batch_id: str) -> bool:
        if self.gate.hard_paused:
            return False
        return self.gate.open or batch_id in self._urgent

    def _yield(self) -> None:
        """The gate closed: hand back queued lines and, with ``abort_on_yield`` (always on a hard
        pause), abort running ones, except urgent batches' (none on a hard pause)."""
        self._settle_claim()
        if not self.held:
            return  # nothing was running: nothing to yield
        leave = lambda h: not self._admissible(h.row.batch_id)  # noqa: E731
        queued = self.held.take_queued(leave)
        running: list[HeldLine] = []
        if self.policy.abort_on_yield or self.gate.hard_paused:
            running = self.held.take_running(leave)
            self._abort([h.request_id for h in running])
        self._stats.yields += 1
        self.lifetime.yields += 1
        if self.export_metrics:
            metrics.YIELDS.labels(self.model).inc()
            metrics.ABORTED.labels(self.model).inc(len(running))
        if not queued and not running:
            return
        self._flush()  # what finished is written before its neighbours are handed back
        self.writer.release([h.row for h in (*queued, *running)], count_attempt=False)
        self._stats.aborted += len(running)
        self._stats.released += len(queued)
        log.info(
            "yielded: %d queued and %d running lines back to pending; %d running lines of "
            "urgent batches continue",
            len(queued),
            len(running),
            len(self.held.running),
        )

    # --- Claims and admission -----------------------------------------------------------------

    def _top_up(self, at: float) -> None:
        may_claim = self.gate.open or (self._urgent and not self.gate.hard_paused)
        if may_claim and at >= self._next_claim_at:
            limit = self._claim_limit()
            if limit and not self.held and self.claim_ahead is not None:
                # Nothing held: the engine waits for this claim. Just its slots' worth, so it
                # starts at once; the rest comes in the next claim, made while it steps.
                limit = min(limit, self.slots)
            if limit and (done := self._claim_or_ahead(at, limit)) is not None:
                claimed, limit = done
                if len(claimed.rows) < limit:
                    # The model has no more runnable lines right now: look again later.
                    self._next_claim_at = at + self.settings.flush_seconds
                if claimed.rows:
                    self._accept(claimed)
        # A step's finished lines get replaced; the lane's limit is exact (lines in flight at a
        # shared server, not an engine's queue).
        feed = self.slots if self.lane else self.slots + max(8, self.slots // 4)
        before = len(self.held.running)
        self.held.admit(self.engine, feed, self._admissible, self._refused)
        self.lines_sent += max(0, len(self.held.running) - before)
        ahead = self.claim_ahead
        if ahead is not None:
            # An engine that empties every step waits for each claim, a round trip and the
            # lines' parse on the claim thread: two claims in flight overlap one's round trip
            # with the other's parse (``offpeak bench control``).
            ahead.depth = ClaimAhead.MAX_DEPTH if self._empties else 1
        if ahead is not None and self.held.running and not ahead.busy:
            # The next claim overlaps the step about to run. An engine that finishes every
            # line within a step (the instant engine, short answers at a GPU's step rate) is
            # empty again at the next top-up, which would then claim with the engine idle.
            limit = self._claim_limit() if may_claim and at >= self._next_claim_at else 0
            if limit:
                urgent = set(self._urgent)
                ahead.start(lambda: self._claim_and_prepare(at, limit, urgent), limit)

    def _claim_limit(self) -> int:
        """Lines to claim now for what is held (``claim_size``). While the engine finishes every
        line within the step it joined, the runner holds up to ``chunk_size`` lines rather than
        ``slots × queue_depth``: a queue a step deep is a claim per step, and the engine waited
        for each (its round trips, the batches read, the lapsed-lease scan: a fixed cost per
        claim) while the claim thread made it (``offpeak bench control``)."""
        depth = self.policy.queue_depth
        if self._empties and self.claim_ahead is not None and self.slots:
            depth = max(depth, self.settings.chunk_size / self.slots)
        return claim_size(
            self.slots, len(self.held), depth, self.settings.chunk_size, self.policy.min_claim
        )

    def _refused(self, held: HeldLine, error: LineError) -> None:
        self.writer.add(results.failed(held.row, error, self.clock.time()))

    def _claim_or_ahead(self, at: float, limit: int) -> tuple[Claimed, int] | None:
        """``(claimed, asked)``: a claim of ``limit`` lines, prepared. On the wall clock while
        lines are held (running, or queued to run next), it is made and prepared on the claim
        thread (``workers.runner.claim_ahead``) and this returns ``None`` until it is done
        (then its lines and the limit it asked for)."""
        ahead = self.claim_ahead
        urgent = set(self._urgent)
        if ahead is None:
            return self._claim_and_prepare(at, limit, urgent), limit
        # Queued lines keep the engine busy while the claim goes on: wait only with none held.
        waiting = not self.held
        done = ahead.take(wait=waiting)
        if done is not None or waiting:
            return done or (self._claim_and_prepare(at, limit, urgent), limit)
        if not ahead.busy:
            ahead.start(lambda: self._claim_and_prepare(at, limit, urgent), limit)
        return None

    def _settle_claim(self) -> None:
        """Wait for the claims in flight and queue their lines (before they are handed back).
        Every claim is settled before a failure (a claim's, or a chunk's ``EngineFault``) is
        raised, so none is left holding lines that would wait out their lease."""
        settled: list[Claimed] = []
        failure: BaseException | None = None
        while self.claim_ahead and self.claim_ahead.in_flight:
            try:
                done = self.claim_ahead.take(wait=True)
            except BaseException as exc:  # that claim leased nothing it returned
                failure = failure or exc
                continue
            if done is not None and done[0].rows:
                settled.append(done[0])
        for claimed in settled:
            try:
                self._accept(claimed)
            except BaseException as exc:  # its rows were handed back: accept the others
                failure = failure or exc
        if failure is not None:
            raise failure

    def _claim_and_prepare(self, at: float, limit: int, urgent: set[str]) -> Claimed:
        """Claim up to ``limit`` lines and prepare them (on the claim thread when it claims).
        Lines already held here are left out of the chunk (``prepare_chunk``): only lines can
        have left the held set by the time the chunk is accepted, as chunks are accepted one
        at a time on the loop thread."""
        rows = self._claim(at, limit)
        if not rows:
            return Claimed(rows)
        try:
            chunk = prepare_chunk(
                rows,
                self.engine,
                held=set(self.held.row_ids()),
                urgent=urgent,
                max_attempts=self.settings.max_line_attempts,
                at=self.clock.time(),
            )
        except EngineFault as exc:  # _accept hands the rows back, then raises it
            return Claimed(rows, fault=exc)
        return Claimed(rows, chunk)

    def _claim(self, at: float, limit: int) -> list[ClaimedRequest]:
        only = None if self.gate.open else set(self._urgent)
        try:
            return self.store.claim(
                self.model, limit, self.owner, at, at + self.settings.lease_seconds, only
            )
        except TRANSIENT_DB_ERRORS as exc:
            log.warning("claim failed, retrying: %s", exc)
            self._next_claim_at = at + self.settings.flush_seconds
            return []

    def _accept(self, claimed: Claimed) -> None:
        """Queue a claimed and prepared chunk, and size the engine's slots for what is now
        held; the decision goes to the log."""
        rows = claimed.rows
        batches = {row.batch_id for row in rows}
        self._stats.chunks += 1
        self._stats.touched.update(batches)
        if claimed.fault is not None:
            # The engine could not tokenize (a remote server's /tokenize is away): unrun lines.
            self.writer.release(rows, count_attempt=False)
            raise claimed.fault
        chunk = claimed.chunk
        assert chunk is not None, "a claim with rows is prepared or has a fault"
        for line in chunk.failed:
            self.writer.add(line)
        if chunk.poison and self.export_metrics:
            worker_metrics.POISON_LINES.labels(self.model).inc(len(chunk.poison))
        self.held.queue(chunk.ready)
        needs = self.held.engine_needs()
        if needs:
            sizing = size_for(needs, self.room, self.engine.max_model_len)
            self.slots = self._sized_slots = sizing.slots
            if self.lane is not None:
                self.slots = min(self.slots, self.lane.limit)
            if self.export_metrics:
                metrics.SLOTS.labels(self.model).set(self.slots)
        self.held.note_batches(batches)
        hit = self._chunk_cached / self._chunk_prompt if self._chunk_prompt else None
        log.info(
            "%s: claimed %d lines of %d batch(es)%s; sizing: %s; prefix-cache hit rate %s since "
            "the last chunk, %.0f%% since start",
            self.model,
            len(rows),
            len(batches),
            f" ({len(batches & self._urgent)} urgent)" if batches & self._urgent else "",
            sizing.explanation if needs else "nothing runnable",
            "n/a" if hit is None else f"{100 * hit:.0f}%",
            100 * self.lifetime.prefix_hit_rate,
        )
        if self.export_metrics:
            metrics.observe_prefix_hit_rate(self.model, self.lifetime.prefix_hit_rate)
        self._chunk_prompt = self._chunk_cached = 0

    # --- Write-back ---------------------------------------------------------------------------

    def _renew(self) -> None:
        # Finished lines whose results are not written yet are still this worker's.
        ids = self.held.row_ids() + self.writer.row_ids()
        self.store.renew(self.owner, time.time() + self.settings.lease_seconds, ids)

    def _flush(self, background: bool = False, wait: bool = False, settle: bool = False) -> None:
        """Write results and accounting, renew leases, and stop the lines of batches that were
        cancelled or ran out of time. Keeps everything for the next try when the database is
        unreachable. ``background``: start the write and act on the previous one's report
        (with ``wait``, after waiting for it: ``ResultWriter.write``)."""
        self._last_flush = self.clock.monotonic()
        at = self.clock.time()
        # The pending results are written before the leases are renewed: only held lines.
        report = self.writer.write(
            at,
            self.held.row_ids(),
            self.held.batch_ids(),
            background=background,
            wait=wait,
            settle=settle,
        )
        if report is None:
            return
        if self.heartbeat and report.renewed:
            self.heartbeat.renewed()
        if report.lost:
            self._drop_lost(set(report.lost))
        stopped: dict[str, str] = {}
        for batch_id, (status, expires_at) in report.statuses.items():
            if status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
                stopped[batch_id] = LineStatus.CANCELLED
            elif status == BatchStatus.EXPIRED or (
                status == BatchStatus.IN_PROGRESS and expires_at <= at
            ):
                stopped[batch_id] = LineStatus.EXPIRED
        if stopped:
            self._stop_batches(stopped, at)

    def _drop_lost(self, lost: set[int]) -> None:
        """Stop running lines another worker took over (our lease had lapsed): they run there,
        and our results for them would not be written anyway."""
        running = self.held.take_running(lambda h: h.row.id in lost)
        self._abort([h.request_id for h in running])
        self.held.take_queued(lambda h: h.row.id in lost)
        log.warning("%d lines were taken over by another worker (lease lapsed); dropped", len(lost))

    def _stop_batches(self, stopped: dict[str, str], at: float) -> None:
        self.held.forget_batches(stopped)
        doomed = lambda h: h.row.batch_id in stopped  # noqa: E731
        running = self.held.take_running(doomed)
        self._abort([h.request_id for h in running])
        queued = self.held.take_queued(doomed)
        if not running and not queued:
            return
        for h in (*running, *queued):
            self.writer.add(results.never_ran(h.row, stopped[h.row.batch_id], at))
        self._stats.touched.update(stopped)
        log.info("stopped %d lines of %s", len(running) + len(queued), ", ".join(sorted(stopped)))

    # --- Faults and stops ---------------------------------------------------------------------

    def _abort(self, request_ids: list[str]) -> None:
        """``engine.abort``; raises ``EngineFault`` if the engine cannot (it is broken)."""
        if not request_ids:
            return
        try:
            self.engine.abort(request_ids)
        except Exception as exc:
            raise EngineFault(f"engine abort failed: {exc!r}", list(self.held.running)) from exc

    def _abort_quietly(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        try:
            self.engine.abort(request_ids)
        except Exception as exc:  # a dead engine cannot abort; it holds nothing any more
            log.warning("engine abort failed (%r); handing the lines back anyway", exc)

    def _give_back(self, count_attempt: bool = True) -> None:
        """The loop raised (the engine failed, a bug, the database refused a write): write what
        finished and hand the rest back so it runs again (here or elsewhere) without waiting
        for the lease. Lines that were inside the engine keep the attempt their claim counted:
        one of them may be the cause (``workers.runner.held.SUSPECT_ATTEMPTS``); queued lines
        do not, nor does any line with ``count_attempt=False`` (a blameless engine fault)."""
        try:
            self._settle_claim()
        except Exception:  # the claim failed too: its lines, if any, wait out their lease
            log.exception("the claim in flight failed")
        running = self.held.take_running(lambda _h: True)
        queued = self.held.take_queued(lambda _h: True)
        self._abort_quietly([h.request_id for h in running])
        unwritable: list[results.Finished] = []
        try:
            self._flush()
        except Exception:
            # Not an outage (the writer keeps results through those): the database refuses
            # these results and would refuse them again. Their lines run again instead.
            log.exception(
                "the database refused %d results; their lines go back", len(self.writer.pending)
            )
            unwritable = self.writer.drop_pending()
        finally:
            self.writer.release([h.row for h in running], count_attempt=count_attempt)
            self.writer.release([h.row for h in queued], count_attempt=False)
            self.writer.release_ids(
                [r.id for r in unwritable], {r.batch_id for r in unwritable}, count_attempt=True
            )

    def _hand_back_all(self) -> None:
        """The worker is stopping: abort what runs, write what finished, and hand every held
        line back to pending without counting an attempt (nothing went wrong with them).

        The finished lines' results are the only copy: while the database is unreachable the
        write-back is tried again every ``flush_seconds`` until ``STOP_MARGIN_SECONDS`` before
        the stop's deadline (``lifecycle.stop_deadline``), rather than left to be run again
        once their leases run out (a stop during a database restart lost them so)."""
        self._settle_claim()
        running = self.held.take_running(lambda _h: True)
        queued = self.held.take_queued(lambda _h: True)
        self._abort_quietly([h.request_id for h in running])
        self._flush()
        deadline = lifecycle.stop_deadline()
        while self.writer.pending and deadline is not None:
            pause = self.settings.flush_seconds
            if time.monotonic() + pause + STOP_MARGIN_SECONDS > deadline:
                log.warning(
                    "stopping with %d results unwritten (the database is unreachable): their "
                    "lines run again once their leases run out",
                    len(self.writer.pending),
                )
                break
            time.sleep(pause)
            self._flush()
        self.writer.release([h.row for h in (*running, *queued)], count_attempt=False)
        if running or queued:
            log.info("stopping: %d lines handed back to pending", len(running) + len(queued))
