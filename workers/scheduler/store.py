"""Where the runner's request lines come from and its results go.

``WorkStore`` is what ``workers.runner.Runner`` needs; ``DbStore`` implements it on the
database through the repositories (one transaction per call), and the simulation implements it
in memory (``MemoryStore``), so the simulated day runs the same runner code as a worker.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from offpeak import scheduler_state
from offpeak.scheduler_state import PauseState
from storage.db import session_scope
from storage.repositories import batches as batches_repo
from storage.repositories import requests as requests_repo
from storage.repositories import scheduler as scheduler_repo
from storage.repositories import shared_claims as shared_claims_repo
from storage.repositories import write_back as write_back_repo
from storage.repositories.engine_chunks import BatchTokens, EnginePeriod
from storage.repositories.requests import ClaimedRequest, FinishedLine
from storage.repositories.scheduler import BatchBacklog, EngineHistory
from storage.repositories.shared_claims import SharedClaim, Shares, WaitingBatch

log = logging.getLogger(__name__)


@dataclass
class WriteBack:
    """One write-back: finished lines, the engine time they took, and a lease heartbeat.

    ``results`` are ``requests_repo.write_results``'s. ``per_batch`` and the period
    (``started_at`` to ``at``, ``busy_seconds`` of engine stepping) make one engine chunk when
    any request finished. ``batch_ids``: batches whose status the runner wants back.
    """

    owner: str
    model: str
    device: str
    at: float
    lease_until: float
    results: Sequence[FinishedLine]
    per_batch: Mapping[str, BatchTokens]
    started_at: float
    busy_seconds: float
    batch_ids: Collection[str] = field(default_factory=set)
    #: Lines the runner holds (queued or running): their leases are renewed, and those it no
    #: longer holds come back in ``WriteBackReport.lost``.
    held_ids: Collection[int] = field(default_factory=set)


@dataclass
class WriteBackReport:
    """What a write-back found: ``batch_id → (status, expires_at)`` of ``WriteBack.batch_ids``,
    and the held lines whose lease another worker took over."""

    statuses: dict[str, tuple[str, float]]
    lost: list[int] = field(default_factory=list)
    #: Whether this write-back renewed the held lines' leases (``WriteBack.held_ids`` given).
    renewed: bool = True
    #: Results not stored: their lines' leases had lapsed (they ran elsewhere, or their batch
    #: ended), so the rows are no longer this worker's to write.
    discarded: int = 0


class WorkStore(Protocol):
    def claim(
        self,
        model: str,
        limit: int,
        owner: str,
        at: float,
        lease_until: float,
        batch_ids: Collection[str] | None = None,
    ) -> list[ClaimedRequest]:
        """Up to ``limit`` runnable lines of ``model``, earliest deadline first, leased to
        ``owner`` until ``lease_until``; only of ``batch_ids`` when given."""
        ...

    def claim_shared(
        self, model: str, limit: int, owner: str, at: float, lease_until: float, shares: Shares
    ) -> SharedClaim:
        """Up to ``limit`` runnable lines of ``model`` as ``shares`` divides them between
        batches (``shared_claims_repo.claim_shared``), and the waiting batches it saw."""
        ...

    def waiting(self, model: str) -> list[WaitingBatch]:
        """``model``'s running batches with their tenants (``shared_claims_repo``)."""
        ...

    def write_back(self, write: WriteBack) -> WriteBackReport:
        """Store ``write`` in one transaction and report what it found."""
        ...

    def release(
        self,
        owner: str,
        ids: Collection[int],
        batch_ids: Collection[str],
        *,
        count_attempt: bool,
    ) -> int:
        """Lines back to pending (see ``requests_repo.release``); returns how many."""
        ...

    def renew(self, owner: str, lease_until: float, ids: Collection[int]) -> int:
        """Extend the leases of the lines ``ids`` that ``owner`` still holds (the heartbeat);
        returns how many."""
        ...

    def backlog(self, model: str) -> list[BatchBacklog]: ...

    def engine_history(self, model: str, since: float) -> EngineHistory: ...

    def live_workers(self, model: str, since: float) -> int: ...

    def save_estimates(self, estimates: Mapping[str, float | None]) -> None: ...

    def pause_state(self, pool: str) -> PauseState: ...

    def publish_load(self, pool: str, reading: dict[str, Any], at: float) -> None: ...


class DbStore:
    """``WorkStore`` on the database at ``url``."""

    def __init__(self, url: str) -> None:
        self.url = url

    def claim(
        self,
        model: str,
        limit: int,
        owner: str,
        at: float,
        lease_until: float,
        batch_ids: Collection[str] | None = None,
    ) -> list[ClaimedRequest]:
        with session_scope(self.url) as session:
            return requests_repo.claim(
                session,
                model=model,
                limit=limit,
                owner=owner,
                lease_until=lease_until,
                at=at,
                batch_ids=batch_ids,
            )

    def claim_shared(
        self, model: str, limit: int, owner: str, at: float, lease_until: float, shares: Shares
    ) -> SharedClaim:
        with session_scope(self.url) as session:
            return shared_claims_repo.claim_shared(
                session,
                model=model,
                limit=limit,
                owner=owner,
                lease_until=lease_until,
                at=at,
                shares=shares,
            )

    def waiting(self, model: str) -> list[WaitingBatch]:
        with session_scope(self.url) as session:
            return shared_claims_repo.waiting_batches(session, model)

    def write_back(self, write: WriteBack) -> WriteBackReport:
        # The engine time goes to the lines actually written: a line another worker took over
        # is billed (once) by that worker, not here too (``write_back.store``).
        period = EnginePeriod(
            worker_id=write.owner,
            model=write.model,
            device=write.device,
            started_at=write.started_at,
            ended_at=write.at,
            busy_seconds=write.busy_seconds,
        )
        with session_scope(self.url) as session:
            stored = write_back_repo.store(
                session,
                write.results,
                period,
                lease_until=write.lease_until,
                held_ids=write.held_ids,
                batch_ids=write.batch_ids,
            )
        for batch_id in stored.tripped:
            log.warning("batch %s: its failure_limit was passed; stopping it", batch_id)
        return WriteBackReport(
            {b: (status, float(expires_at)) for b, (status, expires_at) in stored.statuses.items()},
            sorted(set(write.held_ids) - stored.held),
            discarded=len(write.results) - len(stored.written),
        )

    def release(
        self,
        owner: str,
        ids: Collection[int],
        batch_ids: Collection[str],
        *,
        count_attempt: bool,
    ) -> int:
        if not ids:
            return 0
        with session_scope(self.url) as session:
            released = requests_repo.release(session, owner, ids, count_attempt=count_attempt)
            batches_repo.refresh_counts(session, batch_ids)
        return released

    def renew(self, owner: str, lease_until: float, ids: Collection[int]) -> int:
        if not ids:
            return 0
        with session_scope(self.url) as session:
            return requests_repo.renew_leases(session, owner, lease_until, ids)

    def backlog(self, model: str) -> list[BatchBacklog]:
        with session_scope(self.url) as session:
            return scheduler_repo.backlog(session, model)

    def engine_history(self, model: str, since: float) -> EngineHistory:
        with session_scope(self.url) as session:
            return scheduler_repo.engine_history(session, model, since)

    def live_workers(self, model: str, since: float) -> int:
        with session_scope(self.url) as session:
            return scheduler_repo.live_workers(session, model, since)

    def save_estimates(self, estimates: Mapping[str, float | None]) -> None:
        with session_scope(self.url) as session:
            scheduler_repo.set_estimates(session, estimates)

    def pause_state(self, pool: str) -> PauseState:
        with session_scope(self.url) as session:
            states = scheduler_repo.get_states(
                session, [scheduler_state.PAUSE_ALL_KEY, scheduler_state.pause_key(pool)]
            )
        return scheduler_state.pause_for(states, pool)

    def publish_load(self, pool: str, reading: dict[str, Any], at: float) -> None:
        with session_scope(self.url) as session:
            scheduler_repo.put_state(session, scheduler_state.load_key(pool), reading, at)

    def publish_replicas(self, model: str, value: dict[str, Any], at: float) -> None:
        """The engines ``model``'s backlog needs (``workers.scheduler.slack.Plan``)."""
        with session_scope(self.url) as session:
            scheduler_repo.put_state(session, scheduler_state.replicas_key(model), value, at)
