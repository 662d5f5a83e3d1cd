"""The runner: the scheduler's loop around one model's engine.

Each turn of the loop it reads the load (``workers.scheduler.signals``, every
``load_poll_seconds``) into the hysteresis gate, refreshes the batches' slack
(``workers.scheduler.slack``, every ``estimate_seconds``), tops the engine up and steps it once.

- **Claims** come in chunks sized from the engine's room (``workers.scheduler.dispatch``): the
  runner holds ``slots × queue_depth`` lines, ``slots`` of them running and the rest queued here,
  and claims the difference while the engine decodes, across all batches of the model, earliest
  deadline first, with a lease. Each chunk is ordered so prompts that share a prefix run
  together, and the sizing decision is logged before it runs.
- **Yield**: while the gate is closed (load above high-water until it falls to low-water, an
  admin pause, an unreadable signal) nothing new starts; when it closes mid-chunk, queued lines
  go back to pending and, with ``abort_on_yield``, so do running sequences. Urgent batches
  (slack below their margin) are exempt: they are claimed, admitted and kept whatever the load;
  a hard pause stops them too.
- **Write-back** every ``flush_seconds``: results, the engine time they took (an engine chunk),
  a lease heartbeat, and the batches' statuses, which stop the lines of cancelled or expired
  batches. A database outage only delays it: results wait in memory, and the lease check in
  ``write_results`` keeps a line from being written twice if another worker took it over.

Time comes from an injectable clock and lines from an injectable store, so ``offpeak simulate
day`` drives this same code on a virtual clock.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import orjson

from offpeak import wire
from offpeak.ids import now as unix_now
from offpeak.settings import Settings
from storage.errors import TRANSIENT_DB_ERRORS
from storage.repositories.chunks import BatchTokens
from storage.repositories.requests import ClaimedRequest
from workers import lifecycle, serving
from workers import metrics as worker_metrics
from workers.engine.base import Engine, EngineFault, EngineResult
from workers.planner import StepModel
from workers.scheduler import metrics
from workers.scheduler.clock import Clock, WallClock
from workers.scheduler.dispatch import claim_size, engine_room, prefix_order, size_for
from workers.scheduler.heartbeat import LeaseHeartbeat
from workers.scheduler.hysteresis import Gate
from workers.scheduler.signals import BackgroundMonitor, LoadMonitor, build_signals
from workers.scheduler.slack import Estimate, calibrated, refresh_estimates
from workers.scheduler.store import DbStore, Flush, WorkStore
from workers.serving import LineError, Prepared

log = logging.getLogger(__name__)

#: Seconds of engine stepping over which the runner's own tokens/s is averaged, and the least
#: it must have stepped before that rate is trusted.
RATE_SECONDS = 300.0
RATE_TRUSTED_AFTER = 30.0
#: Errors that mean "the database is unreachable right now", not "this write is wrong".
_DB_DOWN = TRANSIENT_DB_ERRORS
#: A line claimed this many times is a suspect: it was inside an engine (or a worker) that died
#: at least once. Suspects run one at a time beside clean lines, so a line that kills the engine
#: again is the only line charged with it (``Settings.max_line_attempts``).
SUSPECT_ATTEMPTS = 2

_worker_ids: dict[int, str] = {}


def worker_id() -> str:
    """``host:pid:random``, fixed for this process: readable in the leases it writes, and unique
    per start (a container restarted with the same hostname and PID 1 must not adopt its dead
    predecessor's leases). A forked child gets an id of its own."""
    pid = os.getpid()
    if pid not in _worker_ids:
        _worker_ids[pid] = f"{socket.gethostname()}:{pid}:{secrets.token_hex(3)}"
    return _worker_ids[pid]


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


@dataclass
class _Held:
    row: ClaimedRequest
    prepared: Prepared


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
        self._staged: deque[_Held] = deque()
        self._in_flight: dict[str, _Held] = {}
        self._results: list[dict[str, Any]] = []
        #: Batches of lines held (a superset: cleared whenever nothing is held).
        self._held_ids: set[str] = set()
        self._urgent: set[str] = set()
        #: Every batch that has been urgent in this process (the simulation reports it).
        self.urgent_seen: set[str] = set()
        self.estimates: dict[str, Estimate] = {}
        self._next_load_at = -math.inf
        self._next_estimate_at = -math.inf
        self._next_claim_at = -math.inf
        self._last_flush = self.clock.monotonic()
        self._busy_seconds = 0.0
        self._period_started = self.clock.time()
        #: Tokens generated and seconds stepped, decayed over ``RATE_SECONDS`` of stepping.
        self._rate_tokens = self._rate_seconds = 0.0
        self._published_at = -math.inf
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

    def replace_engine(self, engine: Engine) -> None:
        """Drive ``engine`` from now on (a new one after the old failed). Only between runs: the
        old engine's lines were handed back when it failed."""
        assert not self._in_flight and not self._staged, "replace_engine while holding lines"
        self.engine = engine
        self.room = engine_room(engine, self.settings.models.get(self.model))
        self.slots = self.room.max_num_seqs

    # --- The loop -----------------------------------------------------------------------------

    def drain(self) -> DrainStats:
        """Run until nothing admissible is left: the model's work is done, or the gate is
        closed and no urgent line is runnable (the sweep sends another drain later)."""
        return self.run()

    def run(self, until: Callable[[], bool] | None = None) -> DrainStats:
        """Run the loop. Without ``until`` it returns once the engine is empty and nothing
        admissible can be claimed; with it, it waits (``clock.sleep``) for work or a lower load
        until ``until()`` is true. Unfinished lines go back to pending if it raises."""
        stats = self._stats = DrainStats()
        started = self.clock.monotonic()
        # A new drain acts on a fresh reading, not on the one that ended the last.
        self._next_load_at = self._next_estimate_at = self._next_claim_at = -math.inf
        if isinstance(self.monitor, BackgroundMonitor):
            self.monitor.refresh()
        with self.heartbeat.running() if self.heartbeat else nullcontext():
            try:
                self._loop(until)
            except BaseException:
                self._give_back()
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
            if self._in_flight:
                self._step()
                looked_again = False
                if self.clock.monotonic() - self._last_flush >= self.settings.flush_seconds:
                    self._flush()
                continue
            if self._next_claim_at > at and not looked_again:
                # The engine ran dry inside a claim back-off: one more look before idling.
                looked_again, self._next_claim_at = True, -math.inf
                continue
            self._flush()
            if until is None:
                if self._results:
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
        self._release([h.row for h in self._staged], count_attempt=False)
        self._staged.clear()

    def _step(self) -> None:
        running = min(len(self._in_flight), self.slots)
        started = self.clock.monotonic()
        try:
            finished = self.engine.step()
        except Exception as exc:
            raise EngineFault(f"engine step failed: {exc!r}", list(self._in_flight)) from exc
        elapsed = self.clock.monotonic() - started
        self._busy_seconds += elapsed
        self._stats.busy_seconds += elapsed
        # Every running sequence gains a token per step: the rate counts tokens of lines still
        # running too, which finished-line counts miss right after the engine fills up.
        keep = math.exp(-elapsed / RATE_SECONDS)
        self._rate_tokens = self._rate_tokens * keep + running
        self._rate_seconds = self._rate_seconds * keep + elapsed
        created = unix_now()
        for result in finished:
            held = self._in_flight.pop(result.request_id, None)
            if held is None:  # aborted in the same step it finished
                continue
            line = _succeeded(held.row, held.prepared, result, created, self.clock.time())
            self._results.append(line)
            self._count(line)

    def _count(self, line: dict[str, Any]) -> None:
        for stats in (self._stats, self.lifetime):
            stats.requests += 1
            stats.prompt_tokens += line["prompt_tokens"]
            stats.cached_tokens += line["cached_tokens"]
            stats.completion_tokens += line["completion_tokens"]
        self._chunk_prompt += line["prompt_tokens"]
        self._chunk_cached += line["cached_tokens"]

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

    def _publish(self, reading: dict[str, Any], at: float) -> None:
        try:
            self.store.publish_load(self.policy.pool, reading | {"worker": self.owner}, at)
            self._published_at = at
        except _DB_DOWN as exc:
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
            )
        except _DB_DOWN as exc:
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
        if not self._staged and not self._in_flight:
            return  # nothing was running: nothing to yield
        keep = self._admissible
        queued = [h for h in self._staged if not keep(h.row.batch_id)]
        self._staged = deque(h for h in self._staged if keep(h.row.batch_id))
        running: list[_Held] = []
        if self.policy.abort_on_yield or self.gate.hard_paused:
            running = [h for h in self._in_flight.values() if not keep(h.row.batch_id)]
            self._abort([h.prepared.request.request_id for h in running])
            for h in running:
                del self._in_flight[h.prepared.request.request_id]
        self._stats.yields += 1
        self.lifetime.yields += 1
        if self.export_metrics:
            metrics.YIELDS.labels(self.model).inc()
            metrics.ABORTED.labels(self.model).inc(len(running))
        if not queued and not running:
            return
        self._flush()  # what finished is written before its neighbours are handed back
        rows = [h.row for h in (*queued, *running)]
        self._release(rows, count_attempt=False)
        self._stats.aborted += len(running)
        self._stats.released += len(queued)
        log.info(
            "yielded: %d queued and %d running lines back to pending; %d running lines of "
            "urgent batches continue",
            len(queued),
            len(running),
            len(self._in_flight),
        )

    # --- Claims and admission -----------------------------------------------------------------

    def _top_up(self, at: float) -> None:
        may_claim = self.gate.open or (self._urgent and not self.gate.hard_paused)
        if may_claim and at >= self._next_claim_at:
            limit = claim_size(
                self.slots,
                len(self._staged) + len(self._in_flight),
                self.policy.queue_depth,
                self.settings.chunk_size,
                self.policy.min_claim,
            )
            if limit:
                claimed = self._claim(at, limit)
                if len(claimed) < limit:
                    # The model has no more runnable lines right now: look again later.
                    self._next_claim_at = at + self.settings.flush_seconds
                if claimed:
                    self._accept(claimed)
        self._admit()

    def _claim(self, at: float, limit: int) -> list[ClaimedRequest]:
        only = None if self.gate.open else set(self._urgent)
        try:
            return self.store.claim(
                self.model, limit, self.owner, at, at + self.settings.lease_seconds, only
            )
        except _DB_DOWN as exc:
            log.warning("claim failed, retrying: %s", exc)
            self._next_claim_at = at + self.settings.flush_seconds
            return []

    def _accept(self, claimed: list[ClaimedRequest]) -> None:
        """Prepare a claimed chunk, order it by shared prefix (urgent batches first), queue it,
        and size the engine's slots for what is now held; the decision goes to the log."""
        self._stats.chunks += 1
        ready: list[_Held] = []
        held = {h.row.id for h in self._staged} | {h.row.id for h in self._in_flight.values()}
        for row in claimed:
            self._stats.touched.add(row.batch_id)
            if row.id in held:
                # Our own lease had lapsed and the claim took the line back: it is running here.
                continue
            if row.attempts > self.settings.max_line_attempts:
                # It was inside a dying engine or worker every time it ran (and alone among
                # suspects since the first): this line is the cause; it fails alone.
                self._results.append(
                    _failed(row, _crashed_engine(row.attempts - 1), self.clock.time())
                )
                if self.export_metrics:
                    worker_metrics.POISON_LINES.labels(self.model).inc()
                log.error(
                    "line %s of %s (custom_id %r) was running in %d engine failures: failed",
                    row.id,
                    row.batch_id,
                    row.custom_id,
                    row.attempts - 1,
                )
                continue
            try:
                line = orjson.loads(row.line_json)
                prepared = serving.prepare(str(row.id), line["url"], line["body"], self.engine)
            except LineError as exc:
                self._results.append(_failed(row, exc, self.clock.time()))
                continue
            except Exception:  # our bug, not the client's: fail this line alone, keep the chunk
                log.exception("cannot prepare line %s of %s", row.id, row.batch_id)
                self._results.append(_failed(row, _internal_error(), self.clock.time()))
                continue
            if row.batch_id in self._urgent:
                prepared.request.priority = -1  # ahead of other batches' lines in the engine
            ready.append(_Held(row, prepared))
        ordered = prefix_order(ready, lambda h: h.prepared.request.prompt_token_ids)
        ordered.sort(key=lambda h: h.row.batch_id not in self._urgent)  # stable
        self._staged.extend(ordered)
        needs = [
            (len(h.prepared.request.prompt_token_ids), h.prepared.request.sampling.max_tokens)
            for h in (*self._in_flight.values(), *self._staged)
            for _ in range(h.prepared.request.sampling.n)
        ]
        if needs:
            sizing = size_for(needs, self.room, self.engine.max_model_len)
            self.slots = sizing.slots
            if self.export_metrics:
                metrics.SLOTS.labels(self.model).set(self.slots)
        batches = {row.batch_id for row in claimed}
        self._held_ids.update(batches)
        hit = self._chunk_cached / self._chunk_prompt if self._chunk_prompt else None
        log.info(
            "%s: claimed %d lines of %d batch(es)%s; sizing: %s; prefix-cache hit rate %s since "
            "the last chunk, %.0f%% since start",
            self.model,
            len(claimed),
            len(batches),
            f" ({len(batches & self._urgent)} urgent)" if batches & self._urgent else "",
            sizing.explanation if needs else "nothing runnable",
            "n/a" if hit is None else f"{100 * hit:.0f}%",
            100 * self.lifetime.prefix_hit_rate,
        )
        if self.export_metrics:
            metrics.observe_prefix_hit_rate(self.model, self.lifetime.prefix_hit_rate)
        self._chunk_prompt = self._chunk_cached = 0

    def _admit(self) -> None:
        """Feed queued lines to the engine: a little more than its slots, so the sequences that
        finish in one step are replaced in the next. A suspect line (see ``SUSPECT_ATTEMPTS``)
        joins only while no other suspect runs; it waits at the front of the queue meanwhile.

        Raises ``EngineFault`` when ``add`` fails with anything but ``ValueError`` (the engine's
        verdict on the request itself): the line that was being added is a suspect too.
        """
        feed = self.slots + max(8, self.slots // 4)
        # Looked up only when a suspect is next in line: suspects are rare, steps are not.
        suspect_running: bool | None = None
        waiting: list[_Held] = []
        while self._staged and len(self._in_flight) < feed:
            if not self._admissible(self._staged[0].row.batch_id):
                break
            held = self._staged.popleft()
            if _suspect(held):
                if suspect_running is None:
                    suspect_running = any(_suspect(h) for h in self._in_flight.values())
                if suspect_running:
                    waiting.append(held)
                    continue
                suspect_running = True
            request_id = held.prepared.request.request_id
            try:
                self.engine.add(held.prepared.request)
            except ValueError as exc:  # the engine refused the request itself
                self._results.append(_failed(held.row, LineError(str(exc)), self.clock.time()))
                continue
            except Exception as exc:
                # Not a verdict on the line: the engine is broken (dead engine core, a bug).
                # The line counts as inside it, so a line that breaks ``add`` every time is
                # caught by the attempts cap instead of looping forever.
                self._in_flight[request_id] = held
                self._staged.extendleft(reversed(waiting))
                raise EngineFault(
                    f"engine refused a request: {exc!r}", list(self._in_flight)
                ) from exc
            self._in_flight[request_id] = held
        self._staged.extendleft(reversed(waiting))

    # --- Write-back ---------------------------------------------------------------------------

    def _held_row_ids(self, results: bool = True) -> list[int]:
        """Ids of the lines held: queued, running, or finished with the result not yet written.
        Safe from the heartbeat thread: copying a dict's values, a deque or a list holds the
        GIL throughout."""
        held = (*tuple(self._staged), *tuple(self._in_flight.values()))
        # Finished lines whose results are not written yet are still this worker's.
        ids = [h.row.id for h in held]
        return ids + [r["id"] for r in tuple(self._results)] if results else ids

    def _renew(self) -> None:
        self.store.renew(
            self.owner, time.time() + self.settings.lease_seconds, self._held_row_ids()
        )

    def _held_batches(self) -> set[str]:
        if not self._staged and not self._in_flight:
            self._held_ids.clear()
        return set(self._held_ids)

    def _flush(self) -> None:
        """Write results and accounting, renew leases, and stop the lines of batches that were
        cancelled or ran out of time. Keeps everything for the next try when the database is
        unreachable."""
        self._last_flush = self.clock.monotonic()
        at = self.clock.time()
        per_batch: dict[str, BatchTokens] = {}
        for r in self._results:
            if r["status"] == "succeeded":
                tokens = per_batch.setdefault(r["batch_id"], BatchTokens())
                tokens.requests += 1
                tokens.prompt_tokens += r["prompt_tokens"]
                tokens.cached_tokens += r["cached_tokens"]
                tokens.completion_tokens += r["completion_tokens"]
        flush = Flush(
            owner=self.owner,
            model=self.model,
            device=self.device,
            at=at,
            lease_until=at + self.settings.lease_seconds,
            results=list(self._results),
            per_batch=per_batch,
            started_at=self._period_started,
            busy_seconds=self._busy_seconds,
            batch_ids=self._held_batches(),
            # The results in this flush are written before the leases are renewed.
            held_ids=self._held_row_ids(results=False),
        )
        if not flush.results and not flush.batch_ids:
            return
        try:
            written = self.store.flush(flush)
            if self.heartbeat:
                self.heartbeat.renewed()
        except _DB_DOWN as exc:
            log.warning(
                "write-back failed, keeping %d results for the next: %s", len(flush.results), exc
            )
            return
        if per_batch:  # the seconds went into a chunk; a failed flush keeps them for the next
            if self.export_metrics:
                worker_metrics.observe_flush(
                    self.model,
                    self._busy_seconds,
                    sum(t.requests for t in per_batch.values()),
                    sum(t.prompt_tokens for t in per_batch.values()),
                    sum(t.cached_tokens for t in per_batch.values()),
                    sum(t.completion_tokens for t in per_batch.values()),
                )
            self._busy_seconds, self._period_started = 0.0, at
        del self._results[: len(flush.results)]
        if written.lost:
            self._drop_lost(set(written.lost))
        stopped = {}
        for batch_id, (status, expires_at) in written.statuses.items():
            if status in ("cancelling", "cancelled"):
                stopped[batch_id] = "cancelled"
            elif status == "expired" or (status == "in_progress" and expires_at <= at):
                stopped[batch_id] = "expired"
        if stopped:
            self._stop_batches(stopped, at)

    def _drop_lost(self, lost: set[int]) -> None:
        """Stop running lines another worker took over (our lease had lapsed): they run there,
        and our results for them would not be written anyway."""
        doomed = [h for h in self._in_flight.values() if h.row.id in lost]
        self._abort([h.prepared.request.request_id for h in doomed])
        for h in doomed:
            del self._in_flight[h.prepared.request.request_id]
        self._staged = deque(h for h in self._staged if h.row.id not in lost)
        log.warning("%d lines were taken over by another worker (lease lapsed); dropped", len(lost))

    def _stop_batches(self, stopped: dict[str, str], at: float) -> None:
        doomed = [
            h for h in (*self._staged, *self._in_flight.values()) if h.row.batch_id in stopped
        ]
        self._held_ids -= set(stopped)
        if not doomed:
            return
        self._abort([h.prepared.request.request_id for h in doomed])
        for h in doomed:
            self._in_flight.pop(h.prepared.request.request_id, None)
        self._staged = deque(h for h in self._staged if h.row.batch_id not in stopped)
        for h in doomed:
            self._results.append(
                {
                    "id": h.row.id,
                    "batch_id": h.row.batch_id,
                    "status": stopped[h.row.batch_id],
                    "finished_at": at,
                }
            )
        self._stats.touched.update(stopped)
        log.info("stopped %d lines of %s", len(doomed), ", ".join(sorted(stopped)))

    def _release(self, rows: Iterable[ClaimedRequest], *, count_attempt: bool) -> None:
        rows = list(rows)
        if not rows:
            return
        try:
            self.store.release(
                self.owner,
                [r.id for r in rows],
                {r.batch_id for r in rows},
                count_attempt=count_attempt,
            )
        except _DB_DOWN as exc:  # their leases run out instead
            log.warning("cannot hand back %d lines (their leases will run out): %s", len(rows), exc)

    def _release_ids(self, ids: list[int], batch_ids: set[str]) -> None:
        if not ids:
            return
        try:
            self.store.release(self.owner, ids, batch_ids, count_attempt=True)
        except _DB_DOWN as exc:
            log.warning("cannot hand back %d lines (their leases will run out): %s", len(ids), exc)

    def _give_back(self) -> None:
        """The loop raised (the engine failed, a bug, the database refused a write): write what
        finished and hand the rest back so it runs again (here or elsewhere) without waiting
        for the lease. Lines that were inside the engine keep the attempt their claim counted:
        one of them may be the cause (``SUSPECT_ATTEMPTS``); queued lines do not."""
        running = list(self._in_flight.values())
        queued = list(self._staged)
        self._abort_quietly([h.prepared.request.request_id for h in running])
        self._in_flight.clear()
        self._staged.clear()
        unwritable: list[dict[str, Any]] = []
        try:
            self._flush()
        except Exception:
            # Not an outage (``_flush`` keeps results through those): the database refuses
            # these results and would refuse them again. Their lines run again instead.
            log.exception(
                "the database refused %d results; their lines go back", len(self._results)
            )
            unwritable, self._results = self._results, []
        finally:
            self._release([h.row for h in running], count_attempt=True)
            self._release([h.row for h in queued], count_attempt=False)
            self._release_ids([r["id"] for r in unwritable], {r["batch_id"] for r in unwritable})

    def _hand_back_all(self) -> None:
        """The worker is stopping: abort what runs, write what finished, and hand every held
        line back to pending without counting an attempt (nothing went wrong with them)."""
        held = [*self._in_flight.values(), *self._staged]
        self._abort_quietly([h.prepared.request.request_id for h in self._in_flight.values()])
        self._in_flight.clear()
        self._staged.clear()
        self._flush()
        self._release([h.row for h in held], count_attempt=False)
        if held:
            log.info("stopping: %d lines handed back to pending", len(held))

    def _abort(self, request_ids: list[str]) -> None:
        """``engine.abort``; raises ``EngineFault`` if the engine cannot (it is broken)."""
        if not request_ids:
            return
        try:
            self.engine.abort(request_ids)
        except Exception as exc:
            raise EngineFault(f"engine abort failed: {exc!r}", list(self._in_flight)) from exc

    def _abort_quietly(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        try:
            self.engine.abort(request_ids)
        except Exception as exc:  # a dead engine cannot abort; it holds nothing any more
            log.warning("engine abort failed (%r); handing the lines back anyway", exc)


def _succeeded(
    row: ClaimedRequest, prepared: Prepared, result: EngineResult, created: int, at: float
) -> dict[str, Any]:
    body = serving.response_body(prepared, result, created)
    usage = body["usage"]
    return {
        "id": row.id,
        "batch_id": row.batch_id,
        "status": "succeeded",
        "status_code": 200,
        "result": wire.response_line(row.custom_id, 200, body).decode(),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "finished_at": at,
    }


def _suspect(held: _Held) -> bool:
    return held.row.attempts >= SUSPECT_ATTEMPTS


def _crashed_engine(failures: int) -> LineError:
    return LineError(
        f"The engine failed {failures} times while running this request, alone among retried "
        "requests since the first failure; it was not run again.",
        code="engine_failure",
        status_code=500,
    )


def _internal_error() -> LineError:
    return LineError(
        "The server failed to process this request; it was not run.",
        code="internal_error",
        status_code=500,
    )


def _failed(row: ClaimedRequest, error: LineError, at: float) -> dict[str, Any]:
    return {
        "id": row.id,
        "batch_id": row.batch_id,
        "status": "failed",
        "status_code": error.status_code,
        "result": wire.response_line(row.custom_id, error.status_code, error.body()).decode(),
        "finished_at": at,
    }
