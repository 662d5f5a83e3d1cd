"""The simulation's store: ``workers.scheduler.store.WorkStore`` in memory, fed by a day's batch
arrivals, with the sweep's expiry and the finalizer's completion built in."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from offpeak.scheduler_state import PauseState
from offpeak.settings import window_seconds
from offpeak.statuses import BatchStatus, LineStatus
from storage.repositories.requests import ClaimedRequest
from storage.repositories.scheduler import BatchBacklog, EngineHistory
from storage.repositories.shared_claims import SharedClaim, Shares, WaitingBatch
from workers.scheduler.clock import VirtualClock
from workers.scheduler.store import WriteBack, WriteBackReport
from workers.sim.engine import MODEL


@dataclass
class SimBatch:
    id: str
    arrives_at: float
    expires_at: float
    window: str
    requests: int
    status: str = BatchStatus.IN_PROGRESS
    completed: int = 0
    failed: int = 0
    output_tokens: int = 0
    ended_at: float | None = None
    pending: deque[int] = field(default_factory=deque)
    tenant: str = "sim"
    weight: float = 1.0


@dataclass
class SimRow:
    batch_id: str
    custom_id: str
    line_json: str
    status: str = LineStatus.PENDING
    attempts: int = 0


@dataclass(frozen=True)
class Arrival:
    """A batch submitted at ``at`` (seconds after the day starts) with ``(prompt token ids,
    reply tokens)`` per request line."""

    at: float
    lines: list[tuple[list[int], int]]
    tenant: str = "sim"
    weight: float = 1.0


class MemoryStore:
    """The ``WorkStore`` interface in memory, with the sweep's expiry and the finalizer's
    completion built in (checked whenever the runner writes back or estimates)."""

    def __init__(
        self, clock: VirtualClock, arrivals: Sequence[Arrival], window: str, start: float
    ) -> None:
        self.clock = clock
        self.window = window
        self.start = start
        self._arrivals = deque(sorted(arrivals, key=lambda a: a.at))
        self.batches: dict[str, SimBatch] = {}
        self.rows: dict[int, SimRow] = {}
        self._next_row = 1
        self._chunks: deque[tuple[float, int, int, float]] = deque()
        # Requests, completion tokens and busy seconds of ``_chunks``.
        self._sums: list[float] = [0, 0, 0.0]
        self.claims = 0

    # The day's arrivals become batches when the clock reaches them.
    def _ingest(self, at: float) -> None:
        while self._arrivals and self.start + self._arrivals[0].at <= at:
            arrival = self._arrivals.popleft()
            batch_id = f"batch_sim{len(self.batches):04d}"
            batch = SimBatch(
                id=batch_id,
                arrives_at=self.start + arrival.at,
                expires_at=self.start + arrival.at + window_seconds(self.window),
                window=self.window,
                requests=len(arrival.lines),
                tenant=arrival.tenant,
                weight=arrival.weight,
            )
            for i, (prompt, reply) in enumerate(arrival.lines):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": reply}
                line = {"custom_id": f"r{i}", "url": "/v1/completions", "body": body}
                self.rows[self._next_row] = SimRow(batch_id, f"r{i}", orjson.dumps(line).decode())
                batch.pending.append(self._next_row)
                self._next_row += 1
            self.batches[batch_id] = batch

    def _sweep(self, at: float) -> None:
        for batch in self.batches.values():
            if batch.status != BatchStatus.IN_PROGRESS:
                continue
            if batch.completed + batch.failed >= batch.requests:
                batch.status, batch.ended_at = BatchStatus.COMPLETED, at
            elif batch.expires_at <= at:
                batch.status, batch.ended_at = BatchStatus.EXPIRED, at
                batch.pending.clear()

    @property
    def arrivals_left(self) -> int:
        return len(self._arrivals)

    def all_done(self) -> bool:
        return not self._arrivals and all(
            b.status != BatchStatus.IN_PROGRESS for b in self.batches.values()
        )

    def claim(
        self,
        model: str,
        limit: int,
        owner: str,
        at: float,
        lease_until: float,
        batch_ids: Collection[str] | None = None,
    ) -> list[ClaimedRequest]:
        self._ingest(at)
        self.claims += 1
        claimed: list[ClaimedRequest] = []
        for batch in self._runnable(at):
            if batch_ids is None or batch.id in batch_ids:
                self._take(batch, limit - len(claimed), claimed)
            if len(claimed) >= limit:
                break
        return claimed

    def claim_shared(
        self, model: str, limit: int, owner: str, at: float, lease_until: float, shares: Shares
    ) -> SharedClaim:
        """As ``shared_claims_repo.claim_shared`` (no lease runs out in the simulation)."""
        self._ingest(at)
        self.claims += 1
        claimed: list[ClaimedRequest] = []
        runnable = self._runnable(at)
        by_id = {b.id: b for b in runnable}
        known = {*shares.known, *shares.urgent}
        per_batch = [(b, limit) for b in shares.urgent]
        per_batch += [(b.id, shares.fresh) for b in runnable if b.id not in known]
        per_batch += list(shares.quotas)
        for batch_id, quota in per_batch:
            if (batch := by_id.get(batch_id)) is not None:
                self._take(batch, min(quota, limit - len(claimed)), claimed)
        for batch in runnable if shares.fill else ():
            self._take(batch, limit - len(claimed), claimed)
        return SharedClaim(claimed, self.waiting(model))

    def waiting(self, model: str) -> list[WaitingBatch]:
        self._ingest(self.clock.time())
        return [
            WaitingBatch(b.id, b.tenant, b.weight, b.requests - b.completed - b.failed,
                         int(b.expires_at))
            for b in self.batches.values()
            if b.status == BatchStatus.IN_PROGRESS
        ]  # fmt: skip

    def _runnable(self, at: float) -> list[SimBatch]:
        """Batches whose lines may be claimed at ``at``, earliest deadline first."""
        return sorted(
            (
                b
                for b in self.batches.values()
                if b.status == BatchStatus.IN_PROGRESS and b.expires_at > at
            ),
            key=lambda b: (b.expires_at, b.id),
        )

    def _take(self, batch: SimBatch, limit: int, claimed: list[ClaimedRequest]) -> None:
        """Move up to ``limit`` of ``batch``'s pending lines to running, onto ``claimed``."""
        for _ in range(min(limit, len(batch.pending))):
            row_id = batch.pending.popleft()
            row = self.rows[row_id]
            row.status, row.attempts = LineStatus.RUNNING, row.attempts + 1
            claimed.append(
                ClaimedRequest(row_id, batch.id, row.custom_id, row.line_json, row.attempts)
            )

    def write_back(self, write: WriteBack) -> WriteBackReport:
        for result in write.results:
            row = self.rows[result.id]
            if row.status != LineStatus.RUNNING:
                continue
            row.status = result.status
            batch = self.batches[row.batch_id]
            if row.status == LineStatus.SUCCEEDED:
                batch.completed += 1
                batch.output_tokens += result.tokens.completion
            else:
                batch.failed += 1
            row.line_json = ""  # done: free the line
        if write.per_batch:
            tokens = sum(t.completion_tokens for t in write.per_batch.values())
            requests = sum(t.requests for t in write.per_batch.values())
            self._chunks.append((write.at, requests, tokens, write.busy_seconds))
            self._sums[0] += requests
            self._sums[1] += tokens
            self._sums[2] += write.busy_seconds
        self._sweep(write.at)
        return WriteBackReport(
            {
                b: (self.batches[b].status, self.batches[b].expires_at)
                for b in write.batch_ids
                if b in self.batches
            }
        )

    def release(
        self, owner: str, ids: Collection[int], batch_ids: Collection[str], *, count_attempt: bool
    ) -> int:
        released = 0
        for row_id in sorted(ids, reverse=True):  # back to the front, in their order
            row = self.rows[row_id]
            if row.status != LineStatus.RUNNING:
                continue
            row.status = LineStatus.PENDING
            row.attempts -= 0 if count_attempt else 1
            batch = self.batches[row.batch_id]
            if batch.status == BatchStatus.IN_PROGRESS:
                batch.pending.appendleft(row_id)
            released += 1
        return released

    def renew(self, owner: str, lease_until: float, ids: Collection[int]) -> int:
        return 0  # one simulated worker: leases never lapse

    def backlog(self, model: str) -> list[BatchBacklog]:
        at = self.clock.time()
        self._ingest(at)
        self._sweep(at)
        return [
            BatchBacklog(
                b.id,
                b.expires_at,
                window_seconds(b.window),
                b.requests,
                b.completed,
                b.failed,
                b.output_tokens,
            )
            for b in self.batches.values()
            if b.status == BatchStatus.IN_PROGRESS
        ]

    def engine_history(self, model: str, since: float) -> EngineHistory:
        while self._chunks and self._chunks[0][0] < since:
            _, requests, tokens, busy = self._chunks.popleft()
            self._sums[0] -= requests
            self._sums[1] -= tokens
            self._sums[2] -= busy
        total_requests, total_tokens, total_busy = self._sums
        return EngineHistory(
            int(total_requests), int(total_tokens), max(0.0, float(total_busy)), "simulated"
        )

    def live_workers(self, model: str, since: float) -> int:
        return 1

    def save_estimates(self, estimates: Mapping[str, float | None]) -> None:
        return None

    def pause_state(self, pool: str) -> PauseState:
        return PauseState()

    def publish_load(self, pool: str, reading: dict[str, Any], at: float) -> None:
        return None
