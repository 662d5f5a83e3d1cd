"""Write-back: the runner's finished lines go to the store with the engine time they took.

Results wait here until a write-back stores them in one transaction with the engine chunk
(busy seconds split by token counts, ``storage.repositories.engine_chunks``) and a lease renewal. A
database outage only delays them: they stay here for the next try. Lines handed back to pending
go through ``release``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

from offpeak.pricing import token_weights
from offpeak.settings import Settings
from storage.errors import TRANSIENT_DB_ERRORS
from storage.repositories import engine_chunks
from storage.repositories.requests import ClaimedRequest, FinishedLine
from workers import worker_metrics
from workers.runner.server_share import ServerShare, UsageMeter
from workers.scheduler.store import WorkStore, WriteBack, WriteBackReport

log = logging.getLogger(__name__)


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
        self.pending: list[FinishedLine] = []
        #: Engine seconds since the last stored chunk, and when that period began (unix).
        self.busy_seconds = 0.0
        self.period_started = started_at
        #: A co-served (remote) engine's share of its server: then a period's engine seconds
        #: are its busy wall seconds × our share of the server's tokens (``server_share``).
        self.share: ServerShare | None = None

    def share_server(self, meter: UsageMeter | None) -> None:
        """Price engine time by ``meter`` (a remote engine's ``server_meter``), or, with
        ``None``, by the seconds spent stepping (an engine of our own)."""
        weights = token_weights(self.settings)
        self.share = ServerShare(meter, weights) if meter is not None else None

    def add(self, line: FinishedLine) -> None:
        self.pending.append(line)

    def row_ids(self) -> list[int]:
        """Ids of lines finished here and not written yet (still this worker's). Safe from
        another thread: copying a list holds the GIL throughout."""
        return [line.id for line in tuple(self.pending)]

    def write(
        self, at: float, held_ids: Collection[int], batch_ids: Collection[str]
    ) -> WriteBackReport | None:
        """Store the pending lines and their engine chunk, renew the leases of ``held_ids`` and
        read the statuses of ``batch_ids``. Returns ``None`` when there was nothing to do or
        the database is unreachable (everything stays for the next try); raises what a wrong
        write raises (the caller hands the lines back)."""
        per_batch = engine_chunks.tokens_by_batch(self.pending)
        busy = self.busy_seconds
        if self.share is not None and per_batch:
            busy = self.share.seconds(per_batch)
        write = WriteBack(
            owner=self.owner,
            model=self.model,
            device=self.device,
            at=at,
            lease_until=at + self.settings.lease_seconds,
            results=list(self.pending),
            per_batch=per_batch,
            started_at=self.period_started,
            busy_seconds=busy,
            batch_ids=batch_ids,
            held_ids=held_ids,
        )
        if not write.results and not write.batch_ids:
            return None
        try:
            report = self.store.write_back(write)
        except TRANSIENT_DB_ERRORS as exc:
            log.warning(
                "write-back failed, keeping %d results for the next: %s", len(write.results), exc
            )
            return None
        if per_batch:  # the seconds went into a chunk; a failed write keeps them for the next
            if self.share is not None:
                self.share.commit()
            if self.export_metrics:
                worker_metrics.observe_flush(
                    self.model,
                    busy,
                    sum(t.requests for t in per_batch.values()),
                    sum(t.prompt_tokens for t in per_batch.values()),
                    sum(t.cached_tokens for t in per_batch.values()),
                    sum(t.completion_tokens for t in per_batch.values()),
                )
            self.busy_seconds, self.period_started = 0.0, at
        del self.pending[: len(write.results)]
        return report

    def drop_pending(self) -> list[FinishedLine]:
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
