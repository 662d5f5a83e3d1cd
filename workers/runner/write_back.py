"""Write-back: the runner's finished lines go to the store with the engine time they took.

Results wait here until a write-back stores them in one transaction with the engine chunk
(``storage.repositories.engine_chunks``) and a lease renewal; a database outage only delays
them. Lines handed back to pending go through ``release``.

The periodic write-back runs in the background (``write(background=True)``, at most
``MAX_IN_FLIGHT`` on threads of their own) so the engine keeps stepping through a database
round trip (``offpeak bench overhead``). Their reports (batch statuses, lines taken over) are
applied at later write-backs, oldest first; their lines stay in ``pending``, renewed and never
handed back, until the loop thread sees them stored. Every other write (a yield, a stop, a
fault, the end of a drain) first waits for those in flight. Two in flight, because an engine
that answers faster than one write stores would otherwise wait on it (``offpeak bench
control``); two writes of one batch serialize on its row, and a deadlock between them is an
outage like any other (``TRANSIENT_DB_ERRORS``).

Leases are renewed only once ``RENEW_FRACTION`` of the lease has passed (the heartbeat renews
between), as renewing every held line is a write-back's costliest statement; a renewing write
runs on the loop thread, so lines another worker took over stop as soon as it finds them.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from offpeak.billing import token_weights
from offpeak.settings import Settings
from offpeak.statuses import LineStatus
from storage.errors import TRANSIENT_DB_ERRORS
from storage.repositories import engine_chunks
from storage.repositories.requests import ClaimedRequest
from workers import worker_metrics
from workers.runner.results import Finished, held_bytes, stored
from workers.runner.server_share import ServerShare, UsageMeter
from workers.scheduler.store import WorkStore, WriteBack, WriteBackReport

log = logging.getLogger(__name__)

#: A write-back renews the held leases once this fraction of ``lease_seconds`` has passed since
#: its last renewal (the lease heartbeat renews at a third, ``LeaseHeartbeat``).
RENEW_FRACTION = 0.25
#: Background writes in flight at once (the module's docstring says why two).
MAX_IN_FLIGHT = 2


@dataclass
class _Written:
    """A write-back's outcome, applied on the loop thread (``ResultWriter._apply``): the write,
    its report (``None``: the database was unreachable), the engine seconds taken off the
    writer for it (``raw_busy``, given back if it failed) and the lines it stored (``lines``,
    taken out of ``pending`` once it succeeded)."""

    write: WriteBack
    report: WriteBackReport | None
    raw_busy: float
    lines: list[Finished]


@dataclass
class _InFlight:
    """A background write: its future, its lines and the engine seconds and period start it
    took off the writer (given back if it raises)."""

    future: Future[_Written]
    lines: list[Finished]
    busy: tuple[float, float]


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
        #: The background writes in flight (``write(background=True)``), oldest first, their
        #: threads, and the ``id()`` of every line one of them is storing.
        self._inflight: deque[_InFlight] = deque()
        self._executor: ThreadPoolExecutor | None = None
        self._sending: set[int] = set()
        #: ``results.held_bytes`` of every line in ``pending`` (the writes in flight's included).
        self.held_bytes = 0
        #: When a write-back last renewed the held leases (unix seconds).
        self._renewed_at = -math.inf

    def share_server(self, meter: UsageMeter | None) -> None:
        """Price engine time by ``meter`` (a remote engine's ``server_meter``), or, with
        ``None``, by the seconds spent stepping (an engine of our own)."""
        weights = token_weights(self.settings)
        self.share = ServerShare(meter, weights) if meter is not None else None

    def add(self, line: Finished) -> None:
        self.pending.append(line)
        self.held_bytes += held_bytes(line)

    def unsent(self) -> int:
        """Finished lines that no write in flight holds: what the next write would take."""
        return len(self.pending) - len(self._sending)

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
        settle: bool = False,
    ) -> WriteBackReport | None:
        """Store the pending lines and their engine chunk, renew the leases of ``held_ids``
        (when due) and read the statuses of ``batch_ids``. Returns ``None`` when there was
        nothing to do or the database is unreachable (everything stays for the next try);
        raises what a wrong write raises (the caller hands the lines back).

        ``background``: start the write on a writer's thread with the lines no write in
        flight holds, and return the reports of the background writes that finished since
        (``None`` if none); if ``MAX_IN_FLIGHT`` are in flight, do nothing now, unless
        ``wait``: then wait for the oldest, and start this one in the background (lines
        answered faster than they are stored: the caller bounds what piles up behind the
        writes in flight without stopping its own work while the next is stored); with
        ``settle``, wait for every write in flight first (the lines held weigh too much for
        more than one write at a time: ``loop.MAX_HELD_BYTES``). Otherwise
        (the default) wait for every write in flight, then write here and return all their
        reports merged. A write that renews the leases (when due) is never in the
        background: its report says at once which held lines another worker took over. Nor is
        a server-shared engine's (``share_server``): its share is computed from the server's
        counters at write time."""
        if not background or settle:
            earlier = self._collect(keep=0)
        elif wait:
            earlier = self._collect(keep=MAX_IN_FLIGHT - 1)
        else:
            earlier = self._collect(keep=None)
        if background and len(self._inflight) >= MAX_IN_FLIGHT:
            return earlier
        if not self.pending and not batch_ids:
            return earlier
        # Nothing held, nothing to renew: such a write may go to the background (an engine that
        # empties every step holds nothing at its write-backs).
        renew = bool(held_ids) and (
            at - self._renewed_at >= RENEW_FRACTION * self.settings.lease_seconds
        )
        if background and self.share is None and not renew:
            sending = self._sending
            lines = [line for line in self.pending if id(line) not in sending]
            if not lines and not batch_ids:
                return earlier
        elif background and self._inflight and not (wait or settle):
            return earlier  # it must run here, after those in flight: at a later write-back
        else:
            earlier = _merge(earlier, self._collect(keep=0))
            background, lines = False, list(self.pending)
        # Whether an engine chunk is recorded: any answered line (``tokens_by_batch``'s rule).
        answered = any(line.status == LineStatus.SUCCEEDED for line in lines)
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
        if background:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="write-back")
            future = self._executor.submit(self._store, write, lines, busy)
            self._inflight.append(_InFlight(future, lines, (busy if answered else 0.0, started)))
            self._sending.update(map(id, lines))
            return earlier
        try:
            outcome = self._store(write, lines, busy)
        except BaseException:
            self._give_back(busy if answered else 0.0, started)
            raise
        return _merge(earlier, self._apply(outcome))

    def _store(self, write: WriteBack, lines: list[Finished], raw_busy: float) -> _Written:
        """One write-back of ``lines``, on any thread: their records built, their tokens per
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
            return _Written(write, None, raw_busy, lines)
        report.renewed = bool(write.held_ids)
        return _Written(write, report, raw_busy, lines)

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
        if outcome.report.discarded:
            log.warning(
                "%d results not stored: their leases had lapsed (the lines ran elsewhere, or "
                "their batch ended)",
                outcome.report.discarded,
            )
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
        self._forget(outcome.lines)
        return outcome.report

    def _forget(self, lines: list[Finished]) -> None:
        """Take ``lines`` (stored) out of ``pending``. They are its first ones unless an
        earlier write failed (its lines then stay ahead of them): then by identity."""
        n = len(lines)
        if not n:
            return
        self.held_bytes -= sum(map(held_bytes, lines))
        if (
            n <= len(self.pending)
            and self.pending[0] is lines[0]
            and self.pending[n - 1] is lines[-1]
        ):
            del self.pending[:n]
            return
        gone = set(map(id, lines))
        self.pending = [line for line in self.pending if id(line) not in gone]

    def _collect(self, *, keep: int | None) -> WriteBackReport | None:
        """The reports of the background writes that finished, oldest first (a write's report
        is applied only after every older one's). ``keep``: wait until no more than ``keep``
        are in flight (``0``: all done); ``None``: wait for none. Re-raises what a write raised
        (not an outage: the caller hands the lines back), after waiting for every other write
        in flight, their lines still pending and their engine seconds given back."""
        report: WriteBackReport | None = None
        while self._inflight:
            oldest = self._inflight[0]
            must = keep is not None and len(self._inflight) > keep
            if not must and not oldest.future.done():
                break
            self._inflight.popleft()
            self._sending.difference_update(map(id, oldest.lines))
            try:
                outcome = oldest.future.result()
            except BaseException:
                self._give_back(*oldest.busy)
                self._settle_after_failure()
                raise
            report = _merge(report, self._apply(outcome))
        return report

    def _settle_after_failure(self) -> None:
        """A write raised: wait for the others in flight and apply what they stored (or give
        back the seconds of those that raised too), so the caller sees every line still
        pending, and none of them in flight, when it hands them back."""
        while self._inflight:
            other = self._inflight.popleft()
            self._sending.difference_update(map(id, other.lines))
            try:
                self._apply(other.future.result())
            except BaseException:
                self._give_back(*other.busy)

    def drop_pending(self) -> list[Finished]:
        """Forget the pending lines (the database refuses them) and return them."""
        dropped, self.pending = self.pending, []
        self.held_bytes = 0
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
        earlier.discarded + later.discarded,
    )
