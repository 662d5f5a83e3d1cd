"""The claim pipeline: how many lines to claim, claiming them (on the claim thread while the
engine steps, ``workers.runner.claim_ahead``), preparing them (``workers.runner.admission``) and
queueing them in the held lines, sized for the engine (``workers.scheduler.chunking``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

from offpeak.settings import Settings
from storage.errors import TRANSIENT_DB_ERRORS
from storage.repositories.requests import ClaimedRequest
from storage.repositories.shared_claims import SharedClaim, Shares
from workers import worker_metrics
from workers.engine.base import Engine, EngineFault, LoraSpec
from workers.runner.admission import PreparedChunk, prepare_chunk
from workers.runner.claim_ahead import ClaimAhead
from workers.runner.held import HeldLines
from workers.runner.write_back import ResultWriter
from workers.scheduler.chunking import EngineRoom, Sizing, claim_size, size_for
from workers.scheduler.clock import Clock
from workers.scheduler.fair_share import FairShare
from workers.scheduler.store import WorkStore

log = logging.getLogger(__name__)


@dataclass
class Claimed:
    """A claim's rows and the chunk prepared from them (``workers.runner.admission``), or the
    ``fault`` that stopped preparing them (the engine could not tokenize: no line's fault)."""

    rows: list[ClaimedRequest]
    chunk: PreparedChunk | None = None
    fault: EngineFault | None = None


class ClaimPipeline:
    """Claims one model's lines for a runner and queues them, prepared, in its ``held`` lines.

    ``scope()`` names the batches a claim may take when it is made: ``None`` for any, shared
    fairly between tenants after the urgent batches (``workers.scheduler.fair_share``), else
    only those (the urgent ones while the gate is closed), earliest deadline first. With
    ``ahead``, claims made while lines are held run on the claim thread; the runner settles them
    (``settle``) before it yields, stops or hands lines back, so their lines go back with the
    rest.
    """

    def __init__(
        self,
        settings: Settings,
        store: WorkStore,
        model: str,
        owner: str,
        clock: Clock,
        held: HeldLines,
        writer: ResultWriter,
        scope: Callable[[], set[str] | None],
        *,
        ahead: bool,
        export_metrics: bool = True,
        adapters: Callable[[str], LoraSpec] | None = None,
    ) -> None:
        self.settings = settings
        self.policy = settings.scheduler
        self.store, self.model, self.owner = store, model, owner
        self.clock, self.held, self.writer = clock, held, writer
        self.scope = scope
        self.export_metrics = export_metrics
        #: The LoRA adapter a line's ``model`` names (``workers.adapters.AdapterBook.resolve``).
        self.adapters = adapters
        self.ahead: ClaimAhead[Claimed] | None = ClaimAhead() if ahead else None
        self.fair = FairShare()
        #: Clock time before which no claim is made (the model had no more runnable lines, or
        #: the database was away).
        self.next_at = -math.inf
        #: Whether the last step finished every line it ran (``limit``).
        self.empties = False
        #: Clock time of the next look for new batches while the queue is full (``_newcomers``).
        self.look_at = -math.inf

    def limit(self, slots: int) -> int:
        """Lines to claim now for what is held (``claim_size``). While the engine finishes every
        line within the step it joined, up to ``chunk_size`` lines are held rather than
        ``slots × queue_depth``: a queue a step deep is a claim per step, each a fixed cost the
        engine waited for (``offpeak bench control``)."""
        depth = self.policy.queue_depth
        if self.empties and self.ahead is not None and slots:
            depth = max(depth, self.settings.chunk_size / slots)
        return claim_size(
            slots, len(self.held), depth, self.settings.chunk_size, self.policy.min_claim
        )

    def take(
        self, at: float, slots: int, engine: Engine, urgent: Collection[str]
    ) -> Claimed | None:
        """A claim for ``slots`` sequences, prepared for ``engine`` (``urgent`` batches' lines
        first), when one is due and done; ``None`` while it is made on the claim thread."""
        # A claim made ahead is queued once it is done, whatever is held by then: its lines are
        # leased to this worker, so no other claim (nor the look for new batches) can take them.
        if self.ahead is not None and (done := self.ahead.take(wait=False)) is not None:
            return self._taken(at, *done)
        if at < self.next_at:
            return None
        limit = self.limit(slots)
        if not limit:
            return self._newcomers(at, slots, engine, set(urgent))
        if not self.held and self.ahead is not None:
            # Nothing held: the engine waits for this claim. Just its slots' worth, so it
            # starts at once; the rest comes in the next claim, made while it steps.
            limit = min(limit, slots)
        if not limit or (done := self._claim_or_ahead(at, limit, engine, set(urgent))) is None:
            return None
        return self._taken(at, *done)

    def _taken(self, at: float, claimed: Claimed, asked: int) -> Claimed | None:
        """``claimed`` (asked for ``asked`` lines) when it holds any."""
        if len(claimed.rows) < asked:
            # The model has no more runnable lines right now: look again later.
            self.next_at = at + self.settings.flush_seconds
        return claimed if claimed.rows else None

    def overlap_step(
        self, at: float, may_claim: bool, slots: int, engine: Engine, urgent: Collection[str]
    ) -> None:
        """Start the next claim on the claim thread, to overlap the step about to run: an
        engine that finishes every line within a step is empty again at the next top-up."""
        ahead = self.ahead
        if ahead is None:
            return
        # Two claims in flight overlap one's round trip with the other's parse while the engine
        # empties every step (``offpeak bench control``).
        ahead.depth = ClaimAhead.MAX_DEPTH if self.empties else 1
        if not self.held.running or ahead.busy:
            return
        limit = self.limit(slots) if may_claim and at >= self.next_at else 0
        if limit:
            chosen = set(urgent)
            ahead.start(lambda: self._claim_and_prepare(at, limit, engine, chosen), limit)

    def _claim_or_ahead(
        self, at: float, limit: int, engine: Engine, urgent: set[str]
    ) -> tuple[Claimed, int] | None:
        """``(claimed, asked)``: a claim of ``limit`` lines, prepared. On the wall clock while
        lines are held it is made on the claim thread, and this returns ``None`` until it is
        done (then its lines and the limit it asked for)."""
        ahead = self.ahead
        if ahead is None:
            return self._claim_and_prepare(at, limit, engine, urgent), limit
        # Queued lines keep the engine busy while the claim goes on: wait only with none held.
        waiting = not self.held
        done = ahead.take(wait=waiting)
        if done is not None or waiting:
            return done or (self._claim_and_prepare(at, limit, engine, urgent), limit)
        if not ahead.busy:
            ahead.start(lambda: self._claim_and_prepare(at, limit, engine, urgent), limit)
        return None

    def settle(self, accept: Callable[[Claimed], None]) -> None:
        """Wait for the claims in flight and ``accept`` their lines (before they are handed
        back). Every claim is settled before a failure (a claim's, or ``accept``'s) is raised,
        so none is left holding lines that would wait out their lease."""
        settled: list[Claimed] = []
        failure: BaseException | None = None
        while self.ahead and self.ahead.in_flight:
            try:
                done = self.ahead.take(wait=True)
            except BaseException as exc:  # that claim leased nothing it returned
                failure = failure or exc
                continue
            if done is not None and done[0].rows:
                settled.append(done[0])
        for claimed in settled:
            try:
                accept(claimed)
            except BaseException as exc:  # its rows were handed back: accept the others
                failure = failure or exc
        if failure is not None:
            raise failure

    def _newcomers(self, at: float, slots: int, engine: Engine, urgent: set[str]) -> Claimed | None:
        """With the queue full no claim is due, possibly for minutes (long replies): once a
        ``flush_seconds`` this looks for batches with lines left and none held
        (``FairShare.newcomers``) and claims their fresh share (``FairShare.fresh``).
        ``HeldLines.queue`` puts them ahead of the queued lines, so a small batch waits for a
        free slot, not for the queue to drain. Only those batches' pending lines are read
        (``Shares.fill`` off): a batch whose lines another worker holds costs nothing."""
        if at < self.look_at or not slots or not self.fair.seen or self.scope() is not None:
            return None
        self.look_at = at + self.settings.flush_seconds
        try:
            waiting = self.store.waiting(self.model)
            new = self.fair.newcomers(waiting, self.held.batch_ids())
            if not new:
                return None
            fresh = FairShare.fresh(min(slots, self.settings.chunk_size), waiting)
            shares = Shares(
                quotas=tuple((batch_id, fresh) for batch_id in new),
                known=tuple(b.batch_id for b in waiting),
                fill=False,
            )
            lease_until = at + self.settings.lease_seconds
            claimed = self.store.claim_shared(
                self.model, fresh * len(new), self.owner, at, lease_until, shares
            )
        except TRANSIENT_DB_ERRORS as exc:
            log.warning("look for new batches failed, retrying: %s", exc)
            return None
        self.fair.settle(claimed)
        return self._prepare(claimed.rows, engine, urgent) if claimed.rows else None

    def _claim_and_prepare(
        self, at: float, limit: int, engine: Engine, urgent: set[str]
    ) -> Claimed:
        """Claim up to ``limit`` lines and prepare them (on the claim thread when it claims)."""
        return self._prepare(self._claim(at, limit, urgent), engine, urgent)

    def _prepare(self, rows: list[ClaimedRequest], engine: Engine, urgent: set[str]) -> Claimed:
        """Prepare claimed ``rows``. Lines already held are left out (``prepare_chunk``): chunks
        are queued one at a time on the loop thread, so by then lines can only have left the
        held set."""
        if not rows:
            return Claimed(rows)
        try:
            chunk = prepare_chunk(
                rows,
                engine,
                held=set(self.held.row_ids()),
                urgent=urgent,
                max_attempts=self.settings.max_line_attempts,
                at=self.clock.time(),
                adapters=self.adapters,
            )
        except EngineFault as exc:  # ``queue`` hands the rows back, then raises it
            return Claimed(rows, fault=exc)
        return Claimed(rows, chunk)

    def _claim(self, at: float, limit: int, urgent: Collection[str]) -> list[ClaimedRequest]:
        lease_until = at + self.settings.lease_seconds
        try:
            scope = self.scope()
            if scope is not None:
                return self.store.claim(self.model, limit, self.owner, at, lease_until, scope)
            if not self.fair.seen:
                # The first claim knows no batch yet: one look, so it is shared already.
                self.fair.settle(SharedClaim([], self.store.waiting(self.model)))
            shares = self.fair.shares(limit, urgent)
            claimed = self.store.claim_shared(
                self.model, limit, self.owner, at, lease_until, shares
            )
            self.fair.settle(claimed)
            return claimed.rows
        except TRANSIENT_DB_ERRORS as exc:
            log.warning("claim failed, retrying: %s", exc)
            self.next_at = at + self.settings.flush_seconds
            return []

    def queue(self, claimed: Claimed, room: EngineRoom, max_model_len: int) -> Sizing | None:
        """Queue a claimed chunk's ready lines in ``held`` and its failed ones in the writer;
        returns how many sequences of what is now held fit the engine (``None``: nothing
        runnable). Raises the claim's ``fault`` after handing its rows back unrun."""
        if claimed.fault is not None:
            # The engine could not tokenize (a remote server's /tokenize is away): unrun lines.
            self.writer.release(claimed.rows, count_attempt=False)
            raise claimed.fault
        chunk = claimed.chunk
        assert chunk is not None, "a claim with rows is prepared or has a fault"
        for line in chunk.failed:
            self.writer.add(line)
        if chunk.poison and self.export_metrics:
            worker_metrics.POISON_LINES.labels(self.model).inc(len(chunk.poison))
        self.held.queue(chunk.ready)
        needs = self.held.engine_needs(room.block_size if room.prefix_caching else None)
        self.held.note_batches({row.batch_id for row in claimed.rows})
        return size_for(needs, room, max_model_len) if needs else None
