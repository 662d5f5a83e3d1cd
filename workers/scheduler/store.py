"""Where the runner's request lines come from and its results go.

``WorkStore`` is what ``workers.runner.Runner`` needs; ``DbStore`` implements it on the
database through the repositories (one transaction per call), and the simulation implements it
in memory, so the simulated day runs the same runner code as a worker.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from storage.db import session_scope
from storage.repositories import batches as batches_repo
from storage.repositories import chunks as chunks_repo
from storage.repositories import requests as requests_repo
from storage.repositories import scheduler as scheduler_repo
from storage.repositories.chunks import BatchTokens
from storage.repositories.requests import ClaimedRequest
from storage.repositories.scheduler import BatchBacklog, EngineHistory
from workers.scheduler.signals import PauseState


@dataclass
class Flush:
    """One write-back: finished results, the engine time they took, and a lease heartbeat.

    ``results`` dicts are ``requests_repo.write_results``'s. ``per_batch`` and the period
    (``started_at`` to ``at``, ``busy_seconds`` of engine stepping) make one engine chunk when
    any request finished. ``batch_ids``: batches whose status the runner wants back.
    """

    owner: str
    model: str
    device: str
    at: float
    lease_until: float
    results: Sequence[dict[str, Any]]
    per_batch: Mapping[str, BatchTokens]
    started_at: float
    busy_seconds: float
    batch_ids: Collection[str] = field(default_factory=set)
    #: Lines the runner holds (queued or running): their leases are renewed, and those it no
    #: longer holds come back in ``Written.lost``.
    held_ids: Collection[int] = field(default_factory=set)


@dataclass
class Written:
    """What a flush found: ``batch_id → (status, expires_at)`` of ``Flush.batch_ids``, and the
    held lines whose lease another worker took over."""

    statuses: dict[str, tuple[str, float]]
    lost: list[int] = field(default_factory=list)


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

    def flush(self, flush: Flush) -> Written:
        """Store ``flush`` in one transaction and report what it found."""
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


def pause_from_states(states: Mapping[str, Mapping[str, Any]], pool: str) -> PauseState:
    """The switch for ``pool``: a pause of every pool or of this one (a hard one wins)."""
    found = [
        s
        for s in (states.get(scheduler_repo.PAUSE_ALL), states.get(scheduler_repo.pause_key(pool)))
        if s and s.get("paused")
    ]
    if not found:
        return PauseState()
    return PauseState(
        paused=True,
        hard=any(bool(s.get("hard")) for s in found),
        reason="; ".join(str(s["reason"]) for s in found if s.get("reason")) or None,
    )


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

    def flush(self, flush: Flush) -> Written:
        with session_scope(self.url) as session:
            requests_repo.write_results(session, flush.owner, flush.results)
            if flush.per_batch:
                chunks_repo.record(
                    session,
                    worker_id=flush.owner,
                    model=flush.model,
                    device=flush.device,
                    started_at=flush.started_at,
                    ended_at=flush.at,
                    busy_seconds=flush.busy_seconds,
                    per_batch=flush.per_batch,
                )
            if flush.results:
                batches_repo.refresh_counts(session, {r["batch_id"] for r in flush.results})
            renewed = requests_repo.renew_leases(
                session, flush.owner, flush.lease_until, flush.held_ids
            )
            lost = (
                scheduler_repo.not_held(session, flush.owner, flush.held_ids)
                if renewed < len(flush.held_ids)
                else []
            )
            scheduler_repo.heartbeat(session, flush.owner, flush.at)
            states = batches_repo.statuses(session, flush.batch_ids)
        return Written(
            {b: (status, float(expires_at)) for b, (status, expires_at) in states.items()}, lost
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
                session, [scheduler_repo.PAUSE_ALL, scheduler_repo.pause_key(pool)]
            )
        return pause_from_states(states, pool)

    def publish_load(self, pool: str, reading: dict[str, Any], at: float) -> None:
        with session_scope(self.url) as session:
            scheduler_repo.put_state(session, scheduler_repo.load_key(pool), reading, at)
