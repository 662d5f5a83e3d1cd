"""Write-back: the runner's finished lines go to the store with the engine time they took.

Results wait here until a write-back stores them in one transaction with the engine chunk
(busy seconds split by token counts, ``storage.repositories.engine_chunks``) and a lease renewal. A
database outage only delays them: they stay here for the next try. Lines handed back to pending
go through ``release``.

The runner's periodic write-back runs in the **background** (``write(background=True)``, one
write at a time on a thread of its own), overlapping the engine's next steps instead of
stalling them: at GPU step rates (10–40 ms) a 50–300 ms round trip every second cost a fifth
of the engine's tokens (issue 14, ``offpeak bench overhead``). Its report (batch statuses, lines
taken over) is applied at the next write-back; its lines stay in ``pending`` (still this
worker's: renewed, never handed back) until the loop thread sees it stored. Every other write
(a yield, a stop, a fault, the end of a drain) first waits for the one in flight. The records of
answered lines are built by the write itself (``results.Answered``), so in the background on
the writer's thread too.

Leases are renewed by a write-back only once ``RENEW_FRACTION`` of the lease has passed since
the last renewal (the heartbeat renews between them), not every second: renewing 500 held
lines took a third of each write-back. That write is made on the loop thread, so lines another
worker took over are stopped as soon as it finds them (within ``RENEW_FRACTION`` of a lease).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from offpeak.pricing import token_weights
from offpeak.settings import Settings
from offpeak.statuses import LineStatus
from storage.errors import TRANSIENT_DB_ERRORS
from storage.repositories import engine_chunks
from storage.repositories.requests import ClaimedRequest
from workers import worker_metrics
from workers.runner.results import Finished, stored
from workers.runner.server_share import ServerShare, UsageMeter
from workers.scheduler.store import WorkStore, WriteBack, WriteBackReport

log = logging.getLogger(__name__)

#: A write-back renews the held leases once this fraction of ``lease_seconds`` has passed since
#: its last renewal (the lease heartbeat renews at a third, ``LeaseHeartbeat``).
RENEW_FRACTION = 0.25


@dataclass
class _Written:
    """A write-back's outcome, applied on the loop thread (``ResultWriter._apply``): the write,
    its report (``None``: the database was unreachable) and the engine seconds taken off the
    writer for it (``raw_busy``, given back if it failed)."""

    write: WriteBack
    report: WriteBackReport | None
    raw_busy: float


class ResultWriter:
    """Finished lines and engine seconds of one runner, written back by ``write``."""

    def __init__(
        self,
        settings: Settings,
        store: WorkStore,
        owner: str,
        model: str,
        device: str,
        started_at: float,
        export_metrics: bool,
    ) -> None:
        self.settings = settings
        self.store = store
        self.owner = owner
        self.model = model
        self.device = device
        self.export_metrics = export_metrics
        #: Finished lines not yet stored: the only copy of their results.
        self.pending: list[Finished] = []
        #: Engine seconds since the last stored chunk, and when that period began (unix).
        self.busy_seconds = 0.0
        self.period_started = started_at
        #: A co-served (remote) engine's share of its server: then a period's engine seconds
        #: are its busy wall seconds × our share of the server's tokens (``server_share``).
        self.share: ServerShare | None = None
        #: The background write in flight (``write(background=True)``) and its thread.
        self._inflight: Future[_Written] | None = None
        self._executor: ThreadPoolExecutor | None = None
        #: The engine seconds and period start the write in flight took off.
        self._inflight_busy = (0.0, started_at)
        #: When a write-back last renewed the held leases (unix seconds).
        self._renewed_at = -math.inf

    def share_server(self, meter: UsageMeter | None) -> None:
        """Price engine time by ``meter`` (a remote engine's ``server_meter``), or, with
        ``None``, by the seconds spent stepping (an engine of our own)."""
        weights = token_weights(self.settings)
        self.share = ServerShare(meter, weights) if meter is not None else None

    def add(self, line: Finished) -> None:
        self.pending.append(line)

    def row_ids(self) -> list[int]:
        """Ids of lines finished here and not written yet (still this worker's). Safe from
        another thread: copying a list holds the GIL throughout."""
        return [line.id for line in tuple(self.pending)]

    def write(
        self,
        at: float,
        held_ids: Collection[int],
        batch_ids: Collection[str],
        *,
        background: bool = False,
        wait: bool = False,
    ) -> WriteBackReport | None:
        """Store the pending lines and their engine chunk, renew the leases of ``held_ids``
        (when due) and read the statuses of ``batch_ids``. Returns ``None`` when there was
        nothing to do or the database is unreachable (everything stays for the next try);
        raises what a wrong write raises (the caller hands the lines back).

        ``background``: start the write on the writer's thread and return the report of the
        previous background write (``None`` if none finished since); if one is still in
        flight, do nothing now, unless ``wait``: then wait for it, and start this one in the
        background (lines answered faster than they are stored: the caller bounds what piles
        up behind the write in flight without stopping its own work while the next is
        stored). Otherwise (the default) wait for any write in flight, then write here and
        return both reports merged. A write that renews the leases (when due)
        is never in the background: its report says at once which held lines another worker
        took over. Nor is a server-shared engine's (``share_server``): its share is computed
        from the server's counters at write time."""
        earlier = self._collect(wait=wait or not background)
        if background and self._inflight is not None:
            return earlier
        if not self.pending and not batch_ids:
            return earlier
        # Nothing held, nothing to renew: such a write may go to the background (an engine that
        # empties every step holds nothing at its write-backs, which all ran here before).
        renew = bool(held_ids) and (
            at - self._renewed_at >= RENEW_FRACTION * self.settings.lease_seconds
        )
        results = list(self.pending)
        # Whether an engine chunk is recorded: any answered line (``tokens_by_batch``'s rule).
        answered = any(line.status == LineStatus.SUCCEEDED for line in results)
        busy, started = self.busy_seconds, self.period_started
        if answered:  # the seconds go with these results; a failed write gives them back
            self.busy_seconds, self.period_started = 0.0, at
        write = WriteBack(
            owner=self.owner,
            model=self.model,
            device=self.device,
            at=at,
            lease_until=at + self.settings.lease_seconds,
            # ``results`` and ``per_batch`` are filled in by ``_store`` (the records built there).
            results=(),
            per_batch={},
            started_at=started,
            busy_seconds=busy,
            batch_ids=set(batch_ids),
            held_ids=list(held_ids) if renew else [],
        )
        # A renewing write stays on this thread: its report (lines taken over) stops them now.
        if background and self.share is None and not renew:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="write-back")
            self._inflight = self._executor.submit(self._store, write, results, busy)
            self._inflight_busy = (busy if answered else 0.0, started)
            return earlier
        try:
            outcome = self._store(write, results, busy)
        except BaseException:
            self._give_back(busy if answered else 0.0, started)
            raise
        return _merge(earlier, self._apply(outcome))

    def _store(self, write: WriteBack, lines: list[Finished], raw_busy: float) -> _Written:
        """One write-back of ``lines``, on either thread: their records built, their tokens per
        batch summed, then stored; the database unreachable gives no report."""
        results = [stored(line) for line in lines]
        write = replace(write, results=results, per_batch=engine_chunks.tokens_by_batch(results))
        if self.share is not None and write.per_batch:  # never in the background (``write``)
            write.busy_seconds = self.share.seconds(write.per_batch)
        try:
            report = self.store.write_back(write)
        except TRANSIENT_DB_ERRORS as exc:
            log.warning(
                "write-back failed, keeping %d results for the next: %s", len(write.results), exc
            )
            return _Written(write, None, raw_busy)
        report.renewed = bool(write.held_ids)
        return _Written(write, report, raw_busy)

    def _give_back(self, busy: float, started: float) -> None:
        """A write that failed: its engine seconds and period go to the next one."""
        self.busy_seconds += busy
        self.period_started = min(self.period_started, started)

    def _apply(self, outcome: _Written) -> WriteBackReport | None:
        """On the loop thread: drop the stored lines from ``pending`` (or give the engine
        seconds back when the write failed), note a renewal, update the metrics."""
        write = outcome.write
        if outcome.report is None:
            if write.per_batch:
                self._give_back(outcome.raw_busy, write.started_at)
            return None
        if outcome.report.renewed:
            self._renewed_at = write.at
        per_batch = write.per_batch
        if per_batch:
            if self.share is not None:
                self.share.commit()
            if self.export_metrics:
                worker_metrics.observe_flush(
                    self.model,
                    write.busy_seconds,
                    sum(t.requests for t in per_batch.values()),
                    sum(t.prompt_tokens for t in per_batch.values()),
                    sum(t.cached_tokens for t in per_batch.values()),
                    sum(t.completion_tokens for t in per_batch.values()),
                )
        # Only appended to since the write took its copy: its lines are the first ones.
        del self.pending[: len(write.results)]
        return outcome.report

    def _collect(self, *, wait: bool) -> WriteBackReport | None:
        """The report of the background write once it finished (waiting for it if ``wait``);
        re-raises what it raised (not an outage: the caller hands the lines back), its lines
        still pending and its engine seconds given back."""
        inflight = self._inflight
        if inflight is None or (not wait and not inflight.done()):
            return None
        self._inflight = None
        try:
            outcome = inflight.result()
        except BaseException:
            self._give_back(*self._inflight_busy)
            raise
        return self._apply(outcome)

    def drop_pending(self) -> list[Finished]:
        """Forget the pending lines (the database refuses them) and return them."""
        dropped, self.pending = self.pending, []
        return dropped

    def release(self, rows: Iterable[ClaimedRequest], *, count_attempt: bool) -> None:
        """Hand ``rows`` back to pending (``requests_repo.release``); if the database is down,
        their leases run out instead."""
        rows = list(rows)
        self.release_ids([r.id for r in rows], {r.batch_id for r in rows}, count_attempt)

    def release_ids(self, ids: list[int], batch_ids: set[str], count_attempt: bool) -> None:
        if not ids:
            return
        try:
            self.store.release(self.owner, ids, batch_ids, count_attempt=count_attempt)
        except TRANSIENT_DB_ERRORS as exc:
            log.warning("cannot hand back %d lines (their leases will run out): %s", len(ids), exc)


def _merge(
    earlier: WriteBackReport | None, later: WriteBackReport | None
) -> WriteBackReport | None:
    """Two write-backs' reports as one: the later statuses win, the lost lines add up."""
    if earlier is None or later is None:
        return later or earlier
    return WriteBackReport(
        earlier.statuses | later.statuses,
        sorted({*earlier.lost, *later.lost}),
        earlier.renewed or later.renewed,
    )
