"""The batch runner: claims chunks of request lines for one model and keeps the engine full.

A chunk (``settings.chunk_size`` lines, across all batches of the model, earliest deadline
first) is added to the engine at once, so continuous batching always has work; finished results
go back to the database every ``settings.flush_seconds`` together with a lease heartbeat, and the
same round trip tells the runner which batches were cancelled or ran out of time, whose lines it
then aborts.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from offpeak import wire
from offpeak.ids import now
from offpeak.settings import Settings
from storage.db import session_scope
from storage.repositories import batches as batches_repo
from storage.repositories import chunks as chunks_repo
from storage.repositories import requests as requests_repo
from storage.repositories.chunks import BatchTokens
from storage.repositories.requests import ClaimedRequest
from workers import serving
from workers.engine.base import Engine, EngineResult
from workers.serving import LineError, Prepared

log = logging.getLogger(__name__)


def worker_id() -> str:
    """``host:pid``: unique among live workers, readable in the leases it writes."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class DrainStats:
    chunks: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0


class Runner:
    """Runs one model's pending request lines on ``engine`` until none are left.

    Accounting: seconds spent in ``engine.step()`` accumulate until a flush in which some request
    finished; that flush records an engine chunk (busy seconds + the finished requests' tokens per
    batch) in the same transaction as the results, so each second is recorded exactly once.
    """

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        owner: str,
        on_batch_touched: Callable[[str], None],
        device: str = "cpu",
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.owner = owner
        self.on_batch_touched = on_batch_touched
        self.device = device
        self.url = settings.resolved_database_url
        self._busy_seconds = 0.0
        self._period_started = time.time()

    def drain(self) -> DrainStats:
        """Claim and run chunks until the model has no runnable line left."""
        stats = DrainStats()
        started = time.perf_counter()
        while claimed := self._claim():
            self.run_chunk(claimed, stats)
            stats.chunks += 1
        stats.seconds = time.perf_counter() - started
        return stats

    def _claim(self) -> list[ClaimedRequest]:
        at = time.time()
        with session_scope(self.url) as session:
            return requests_repo.claim(
                session,
                model=self.engine.model_name,
                limit=self.settings.chunk_size,
                owner=self.owner,
                lease_until=at + self.settings.lease_seconds,
                at=at,
            )

    def run_chunk(self, claimed: list[ClaimedRequest], stats: DrainStats | None = None) -> None:
        """Run ``claimed`` lines to the end (or until their batch is cancelled or expires)."""
        stats = stats or DrainStats()
        created = now()
        in_flight: dict[str, tuple[ClaimedRequest, Prepared]] = {}
        results: list[dict[str, Any]] = []
        batch_ids = {row.batch_id for row in claimed}
        for row in claimed:
            try:
                line = orjson.loads(row.line_json)
                prepared = serving.prepare(str(row.id), line["url"], line["body"], self.engine)
                self.engine.add(prepared.request)
            except LineError as exc:
                results.append(_failed(row, exc))
                continue
            except ValueError as exc:  # the engine refused the request itself
                results.append(_failed(row, LineError(str(exc))))
                continue
            in_flight[prepared.request.request_id] = (row, prepared)
        try:
            last_flush = time.monotonic()
            while self.engine.num_unfinished():
                step_started = time.perf_counter()
                finished = self.engine.step()
                self._busy_seconds += time.perf_counter() - step_started
                for result in finished:
                    row, prepared = in_flight.pop(result.request_id)
                    results.append(_succeeded(row, prepared, result, created))
                    stats.requests += 1
                    stats.prompt_tokens += result.prompt_tokens
                    stats.completion_tokens += sum(len(c.token_ids) for c in result.completions)
                if time.monotonic() - last_flush >= self.settings.flush_seconds:
                    stopped = self._flush(results, batch_ids)
                    self._stop_batches(stopped, in_flight, results)
                    last_flush = time.monotonic()
            self._flush(results, batch_ids)
        except BaseException:
            # The engine failed or the worker is shutting down: give unfinished lines back so
            # they run again (here or on another worker) instead of waiting for the lease.
            self.engine.abort(list(in_flight))
            with session_scope(self.url) as session:
                requests_repo.write_results(session, self.owner, results)
                requests_repo.release(
                    session, self.owner, [row.id for row, _ in in_flight.values()]
                )
                batches_repo.refresh_counts(session, batch_ids)
            raise
        for batch_id in batch_ids:
            self.on_batch_touched(batch_id)

    def _flush(self, results: list[dict[str, Any]], batch_ids: set[str]) -> dict[str, str]:
        """Write finished results, renew leases, and return the batches whose lines must stop
        (``batch_id → "cancelled" | "expired"``). Empties ``results``."""
        at = time.time()
        per_batch: dict[str, BatchTokens] = {}
        for r in results:
            if r["status"] == "succeeded":
                tokens = per_batch.setdefault(r["batch_id"], BatchTokens())
                tokens.requests += 1
                tokens.prompt_tokens += r["prompt_tokens"]
                tokens.cached_tokens += r["cached_tokens"]
                tokens.completion_tokens += r["completion_tokens"]
        with session_scope(self.url) as session:
            requests_repo.write_results(session, self.owner, results)
            if per_batch:
                chunks_repo.record(
                    session,
                    worker_id=self.owner,
                    model=self.engine.model_name,
                    device=self.device,
                    started_at=self._period_started,
                    ended_at=at,
                    busy_seconds=self._busy_seconds,
                    per_batch=per_batch,
                )
            if results:
                batches_repo.refresh_counts(session, {r["batch_id"] for r in results})
            requests_repo.renew_leases(session, self.owner, at + self.settings.lease_seconds)
            states = batches_repo.statuses(session, batch_ids)
        if per_batch:  # only now: a failed transaction keeps the seconds for the next flush
            self._busy_seconds, self._period_started = 0.0, at
        results.clear()
        stopped = {}
        for batch_id, (status, expires_at) in states.items():
            if status == "cancelling":
                stopped[batch_id] = "cancelled"
            elif expires_at <= at:
                stopped[batch_id] = "expired"
        return stopped

    def _stop_batches(
        self,
        stopped: dict[str, str],
        in_flight: dict[str, tuple[ClaimedRequest, Prepared]],
        results: list[dict[str, Any]],
    ) -> None:
        if not stopped:
            return
        doomed = [rid for rid, (row, _) in in_flight.items() if row.batch_id in stopped]
        self.engine.abort(doomed)
        for request_id in doomed:
            row, _ = in_flight.pop(request_id)
            results.append(
                {
                    "id": row.id,
                    "batch_id": row.batch_id,
                    "status": stopped[row.batch_id],
                    "finished_at": time.time(),
                }
            )
        for batch_id in stopped:
            self.on_batch_touched(batch_id)
        log.info("stopped %d lines of %s", len(doomed), ", ".join(sorted(stopped)))


def _succeeded(
    row: ClaimedRequest, prepared: Prepared, result: EngineResult, created: int
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
        "finished_at": time.time(),
    }


def _failed(row: ClaimedRequest, error: LineError) -> dict[str, Any]:
    return {
        "id": row.id,
        "batch_id": row.batch_id,
        "status": "failed",
        "status_code": error.status_code,
        "result": wire.response_line(row.custom_id, error.status_code, error.body()).decode(),
        "finished_at": time.time(),
    }
