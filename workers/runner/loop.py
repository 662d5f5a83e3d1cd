"""The runner's loop: load, deadlines, claims, engine steps and write-backs for one model.

Each turn it reads the load into the hysteresis gate (``workers.runner.load_gate``, every
``load_poll_seconds``), refreshes the batches' slack and the urgent set
(``workers.runner.urgency``, every ``estimate_seconds``), tops the engine up and steps it once.

- **Claims** (``workers.runner.claims``) come in chunks sized from the engine's room: the
  runner holds ``slots × queue_depth`` lines, ``slots`` of them running and the rest queued here
  (``workers.runner.held``), and claims the difference while the engine decodes, across all
  batches of the model, with a lease: urgent batches first, then shared fairly between tenants
  (``workers.scheduler.fair_share``). The sizing decision is logged before a chunk runs.
- **Yield**: while the gate is closed (load above high-water until it falls to low-water, an
  admin pause, an unreadable signal) nothing new starts; when it closes mid-chunk, queued lines
  go back to pending and, with ``abort_on_yield``, so do running sequences. Urgent batches
  (slack below their margin) are exempt: they are claimed, admitted and kept whatever the load;
  a hard pause stops them too.
- **The batch lane** (``workers.lane.steering``): with a shared real-time server, the
  lane's limit caps the slots and the lines above it go back to pending.
- **Write-back** every ``flush_seconds`` (``workers.runner.write_back``): results, the engine
  time they took, a lease heartbeat, and the batches' statuses, which stop the lines of
  cancelled or expired batches. A database outage only delays it.
- **Faults** (``workers.runner.hand_back``): an engine that fails raises ``EngineFault`` after
  every held line went back to pending; a stop request (``workers.lifecycle``) hands everything
  back and returns.

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

from offpeak.ids import now as unix_now
from offpeak.settings import Settings
from offpeak.statuses import BatchStatus, LineStatus
from workers import lifecycle
from workers.adapters import AdapterBook
from workers.engine.base import Engine, EngineFault, LoraSpec
from workers.engine.release import startup_seconds
from workers.engine_io import LineError
from workers.lane.controller import LaneDecision
from workers.lane.fleet_steering import FleetSteering, steering_for
from workers.lane.lane_metrics import LANE_ABORTED
from workers.lane.scraper import ServerMetrics
from workers.lane.steering import LaneSteering
from workers.planner import StepModel
from workers.runner import results
from workers.runner.claims import Claimed, ClaimPipeline
from workers.runner.hand_back import give_back, hand_back_all
from workers.runner.held import HeldLine, HeldLines
from workers.runner.load_gate import LoadGate
from workers.runner.stats import DrainStats, TokenRate
from workers.runner.urgency import Urgency
from workers.runner.write_back import ResultWriter
from workers.scheduler import scheduler_metrics as metrics
from workers.scheduler.chunking import engine_room
from workers.scheduler.clock import Clock, WallClock
from workers.scheduler.lease_heartbeat import LeaseHeartbeat
from workers.scheduler.signals import LoadMonitor
from workers.scheduler.slack import Estimate, calibrated
from workers.scheduler.store import DbStore, WorkStore

log = logging.getLogger(__name__)

#: Finished lines not yet sent to a write past which the write-back waits for room among the
#: writes in flight (``write_back.MAX_IN_FLIGHT``): an engine faster than the database would
#: otherwise pile up records behind lagging writes. A GPU's second of answers mostly fits.
MAX_PENDING_LINES = 512
#: ``results.held_bytes`` of the finished lines held past which the write-back waits for every
#: write in flight: heavy lines (embeddings, long completions) keep one write in flight, light
#: ones get ``MAX_IN_FLIGHT`` writes of ``MAX_PENDING_LINES`` each.
MAX_HELD_BYTES = 1 << 20


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
        adapters: Callable[[str], LoraSpec] | None = None,
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
        self.load = LoadGate(
            self.policy, self.store, owner, self.clock, monitor, export_metrics=export_metrics
        )
        self.gate = self.load.gate
        self.room = engine_room(engine, settings.models.get(self.model))
        self.slots = self.room.max_num_seqs
        #: Fallback throughput before any is measured: the calibrated or the default step model.
        self.step_model = step_model or calibrated(settings, self.model, device)
        self.held = HeldLines()
        #: Batches cancelled or expired while this runner held their lines, and what those lines
        #: became: a claim in flight when they stopped can still bring more of them.
        self._stopped: dict[str, str] = {}
        #: The batch lane: batch requests in flight at a shared real-time server, steered by
        #: its latencies; ``None`` when off.
        self.lane = steering_for(
            engine,
            lambda: self.engine,
            self.policy,
            settings.models.get(self.model),
            self.room.max_num_seqs,
            self.step_model,
            lane_metrics,
            self.model,
            export_metrics=export_metrics,
        )
        self.lane_metrics = self.lane.server if self.lane is not None else lane_metrics
        if self.lane is not None:
            self.slots = 0
        self._sized_slots = self.room.max_num_seqs
        self.writer = ResultWriter(
            settings, self.store, owner, self.model, device, self.clock.time(), export_metrics
        )
        # A remote engine's server is shared: its time is charged by our share of its tokens.
        self.writer.share_server(engine.server_meter)
        self.urgency = Urgency(settings, self.store, self.model, export_metrics=export_metrics)
        #: The urgent batches (the same set as ``urgency.urgent``, which updates it in place).
        self._urgent = self.urgency.urgent
        #: Claims on a thread while the engine steps on the wall clock; not in the simulation
        #: (virtual clock) nor with the batch lane, which sends lines to an exact limit.
        self.claims = ClaimPipeline(
            settings,
            self.store,
            self.model,
            owner,
            self.clock,
            self.held,
            self.writer,
            lambda: None if self.gate.open else set(self._urgent),
            ahead=isinstance(self.clock, WallClock) and self.lane is None,
            export_metrics=export_metrics,
            # The registered adapters are read from the database that the default store is.
            adapters=adapters
            or AdapterBook(
                settings, self.model, settings.resolved_database_url if store is None else None
            ).resolve,
        )
        self._last_flush = self.clock.monotonic()
        #: The engine's recent tokens/s, for the slack estimates.
        self.rate = TokenRate()
        self._chunk_prompt = self._chunk_cached = 0
        #: This process's totals, for the prefix-cache hit rate in logs and metrics.
        self.lifetime = DrainStats()
        self._stats = DrainStats()
        #: Renews the leases between write-backs (a long step); off in the simulation.
        self.heartbeat: LeaseHeartbeat | None = (
            LeaseHeartbeat(self._renew, settings.lease_seconds)
            if isinstance(self.clock, WallClock)
            else None
        )

    @property
    def urgent_seen(self) -> set[str]:
        """Every batch that has been urgent in this process (the simulation reports it)."""
        return self.urgency.seen

    @property
    def estimates(self) -> dict[str, Estimate]:
        """The latest slack estimate of each running batch, by batch id."""
        return self.urgency.estimates

    @property
    def lane_decisions(self) -> deque[LaneDecision]:
        """The batch lane's recent decisions, oldest first (empty with the lane off)."""
        return self.lane.decisions if self.lane is not None else deque()

    def replace_engine(self, engine: Engine) -> None:
        """Drive ``engine`` from now on (a new one after the old failed). Only between runs: the
        old engine's lines were handed back when it failed."""
        assert not self.held, "replace_engine while holding lines"
        self.engine = engine
        self.writer.share_server(engine.server_meter)
        self.room = engine_room(engine, self.settings.models.get(self.model))
        self.slots = self._sized_slots = self.room.max_num_seqs
        if self.lane is not None:
            self.lane.resize(self.room.max_num_seqs)
            self.slots = min(self.slots, self.lane.limit)

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
        self.urgency.next_at = self.claims.next_at = -math.inf
        self.load.restart()
        with self.heartbeat.running() if self.heartbeat else nullcontext():
            try:
                self._loop(until)
            except BaseException as exc:
                # A server that went away (a remote engine) is no line's fault.
                self._give_back(count_attempt=not (isinstance(exc, EngineFault) and exc.blameless))
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
                    # On the wall clock the write-back overlaps the next steps
                    # (``workers.runner.write_back``); past the backlog bound it first waits for
                    # room among the writes in flight (past the bytes bound, for all of them).
                    self._flush(background=self.heartbeat is not None, wait=backlog, settle=heavy)
                continue
            if self._lane_waits() and not (until is not None and until()):
                # The lane has no room at the server yet (learning, or real-time is busy): its
                # lines wait here, leases renewed, rather than go back and be claimed again.
                self.clock.sleep(self.policy.lane.control_seconds)
                continue
            if self.claims.next_at > at and not looked_again:
                # The engine ran dry inside a claim back-off: one more look before idling.
                looked_again, self.claims.next_at = True, -math.inf
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
        self.claims.settle(self._accept)
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
        self.held.stepped()
        elapsed = self.clock.monotonic() - started
        self.writer.busy_seconds += elapsed
        self._stats.busy_seconds += elapsed
        # Every running sequence gains a token per step: the rate counts tokens of lines still
        # running too, which finished-line counts miss right after the engine fills up. A
        # remote engine's step is a poll, not a decode step: it counts the tokens that finished.
        if self.engine.capabilities.step_is_poll:
            running = sum(len(c.token_ids) for r in finished for c in r.completions)
        self.rate.add(running, elapsed)
        # Every line the step ran finished in it (the instant engine, answers of a token or
        # two): the next claim is then all the engine has to run (``ClaimPipeline.limit``).
        self.claims.empties = bool(finished) and len(finished) >= ran and not self.lane
        # One clock reading for the step's lines and their token counts added to the totals once
        # a step: this loop runs between two engine steps for every line.
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
            # Its record is built when it is written back (off this thread, see ``write_back``).
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
        if self.load.observe(at):
            self._yield()
        if self.urgency.due(at):
            self.urgency.refresh(
                at,
                self.step_model,
                self.slots,
                self.rate.per_second,
                startup_seconds(self.engine),
            )
        if self.lane is not None and self.lane.due(self.clock.monotonic()):
            self._steer_lane(self.lane)

    # --- The batch lane -----------------------------------------------------------------------

    def _lane_waits(self) -> bool:
        return (
            self.lane is not None
            and bool(self.held.queued)
            and self.slots == 0
            and not self.gate.hard_paused
            and not lifecycle.stop_requested()
        )

    def _steer_lane(self, lane: LaneSteering | FleetSteering) -> None:
        """One lane decision: the new limit becomes the engine's slots; running lines above it
        are aborted, newest first (urgent batches' last), and go back to pending."""
        running = {rid: h.row.batch_id for rid, h in self.held.running.items()}
        urgent_held = any(h.row.batch_id in self._urgent for h in self.held.all())
        limit, doomed = lane.steer(
            self.clock.monotonic(), running, urgent_held, lambda b: b in self._urgent
        )
        self.slots = min(self._sized_slots, limit)
        if self.export_metrics:
            metrics.SLOTS.labels(self.model).set(self.slots)
        if not doomed:
            return
        doomed_ids = set(doomed)
        taken = self.held.take_running(lambda h: h.request_id in doomed_ids)
        self._abort([h.request_id for h in taken])
        self._flush()  # what finished is written before its neighbours are handed back
        self.writer.release([h.row for h in taken], count_attempt=False)
        self._stats.aborted += len(taken)
        if self.export_metrics:
            LANE_ABORTED.labels(self.model).inc(len(taken))
        log.info("%s: lane aborted %d running batch lines back to pending", self.model, len(taken))

    def _admissible(self, batch_id: str) -> bool:
        if self.gate.hard_paused:
            return False
        return self.gate.open or batch_id in self._urgent

    def _yield(self) -> None:
        """The gate closed: hand back queued lines and, with ``abort_on_yield`` (always on a hard
        pause), abort running ones, except urgent batches' (none on a hard pause)."""
        self.claims.settle(self._accept)
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
        may_claim = bool(self.gate.open or (self._urgent and not self.gate.hard_paused))
        if may_claim and (claimed := self.claims.take(at, self.slots, self.engine, self._urgent)):
            self._accept(claimed)
        # A step's finished lines get replaced; the lane's limit is exact (lines in flight at a
        # shared server, not an engine's queue).
        feed = self.slots if self.lane else self.slots + max(8, self.slots // 4)
        before = len(self.held.running)
        self.held.admit(self.engine, feed, self._admissible, self._refused)
        if self.lane is not None:
            self.lane.lines_sent += max(0, len(self.held.running) - before)
        self.claims.overlap_step(at, may_claim, self.slots, self.engine, self._urgent)

    def _refused(self, held: HeldLine, error: LineError) -> None:
        self.writer.add(results.failed(held.row, error, self.clock.time()))

    def _accept(self, claimed: Claimed) -> None:
        """Queue a claimed and prepared chunk (``ClaimPipeline.queue``) and size the engine's
        slots for what is now held; the decision goes to the log."""
        rows = claimed.rows
        batches = {row.batch_id for row in rows}
        self._stats.chunks += 1
        self._stats.touched.update(batches)
        sizing = self.claims.queue(claimed, self.room, self.engine.max_model_len)
        if late := {b: self._stopped[b] for b in batches if b in self._stopped}:
            self._stop_batches(late, self.clock.time())
        if sizing is not None:
            self.slots = self._sized_slots = sizing.slots
            if self.lane is not None:
                self.slots = min(self.slots, self.lane.limit)
            if self.export_metrics:
                metrics.SLOTS.labels(self.model).set(self.slots)
        hit = self._chunk_cached / self._chunk_prompt if self._chunk_prompt else None
        log.info(
            "%s: claimed %d lines of %d batch(es)%s; sizing: %s; prefix-cache hit rate %s since "
            "the last chunk, %.0f%% since start",
            self.model,
            len(rows),
            len(batches),
            f" ({len(batches & self._urgent)} urgent)" if batches & self._urgent else "",
            sizing.explanation if sizing is not None else "nothing runnable",
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
        self._stopped.update(stopped)
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

    def _give_back(self, count_attempt: bool = True) -> None:
        """The loop raised: settle the claims in flight and hand every held line back
        (``hand_back.give_back``)."""
        try:
            self.claims.settle(self._accept)
        except Exception:  # the claim failed too: its lines, if any, wait out their lease
            log.exception("the claim in flight failed")
        give_back(self.engine, self.held, self.writer, self._flush, count_attempt=count_attempt)

    def _hand_back_all(self) -> None:
        """The worker is stopping: settle the claims in flight, then hand every held line back
        unrun (``hand_back.hand_back_all``)."""
        self.claims.settle(self._accept)
        hand_back_all(self.engine, self.held, self.writer, self._flush, self.settings.flush_seconds)
