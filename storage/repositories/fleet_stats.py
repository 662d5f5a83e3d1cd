"""The fleet's statistics, the queries behind ``/metrics`` and the dashboard
(``api.services.fleet_metrics``, ``api.services.dashboard``, ``workers.worker_metrics``): queue
depth, engine throughput over a recent window, batches per status, the scheduler's shared state,
and the load-signal history.

Every query is bounded by an index (request status, chunk start time, sample time), so a scrape
costs the same on a database with a year of history as on a new one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Float, cast, delete, func, insert, or_, select
from sqlalchemy.orm import Session

from offpeak.scheduler_state import LOAD_PREFIX, PAUSE_ALL_KEY, PAUSE_PREFIX, REPLICAS_PREFIX
from offpeak.statuses import LineStatus
from storage.models import (
    Batch,
    EngineChunk,
    EngineChunkBatch,
    LoadSample,
    RequestLine,
    SchedulerState,
)

#: An accounting period longer than this is not looked for when summing a recent window: a chunk
#: is recorded at least every time a request finishes, so only an idle engine has longer ones.
MAX_CHUNK_SECONDS = 3600.0


def queue_depth(session: Session, tenant_id: str | None = None) -> list[tuple[str, str, int, int]]:
    """``(model, status, requests, bytes)`` of request lines not finished yet (``pending`` or
    ``running``): how many, and the bytes of their JSON lines (a prompt-size proxy); only
    ``tenant_id``'s batches' if given."""
    query = (
        select(
            RequestLine.model,
            RequestLine.status,
            func.count(),
            func.coalesce(func.sum(func.length(RequestLine.line_json)), 0),
        )
        .where(RequestLine.status.in_(LineStatus.UNFINISHED))
        .group_by(RequestLine.model, RequestLine.status)
    )
    if tenant_id is not None:
        query = query.join(Batch, Batch.id == RequestLine.batch_id).where(
            Batch.tenant_id == tenant_id
        )
    rows = session.execute(query)
    return [(model, status, int(n), int(size)) for model, status, n, size in rows]


def pending_since(session: Session) -> list[tuple[str, float, int]]:
    """``(model, in_progress_at, pending requests)`` per running batch: each pending line has
    waited since its batch became runnable."""
    rows = session.execute(
        select(RequestLine.model, Batch.in_progress_at, func.count())
        .join(Batch, Batch.id == RequestLine.batch_id)
        .where(RequestLine.status == LineStatus.PENDING, Batch.in_progress_at.is_not(None))
        .group_by(RequestLine.model, Batch.id, Batch.in_progress_at)
    )
    return [(model, float(started or 0), int(n)) for model, started, n in rows]


def batches_by_status(session: Session) -> dict[str, int]:
    rows = session.execute(select(Batch.status, func.count()).group_by(Batch.status))
    return {status: int(n) for status, n in rows}


@dataclass(frozen=True)
class EngineWindow:
    """One worker's engine activity for one model over a recent window."""

    model: str
    worker_id: str
    device: str
    busy_seconds: float
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def engine_window(
    session: Session, since: float, worker_id: str | None = None, tenant_id: str | None = None
) -> list[EngineWindow]:
    """Chunks that ended after ``since`` (unix seconds), summed per model, worker and device;
    only ``worker_id``'s if given. With ``tenant_id``: only that tenant's share of each chunk
    (its batches' requests and tokens, ``engine_chunk_batches``, and the chunk's busy seconds
    split by requests, as ``tenant_views.served_since`` splits them)."""
    if tenant_id is None:
        busy: Any = EngineChunk.busy_seconds
        source: Any = EngineChunk
    else:
        busy = (
            EngineChunk.busy_seconds
            * EngineChunkBatch.requests
            / func.nullif(EngineChunk.requests, 0)
        )
        source = EngineChunkBatch
    query = (
        select(
            EngineChunk.model,
            EngineChunk.worker_id,
            EngineChunk.device,
            func.coalesce(func.sum(busy), 0.0),
            func.sum(source.requests),
            func.sum(source.prompt_tokens),
            func.sum(source.cached_tokens),
            func.sum(source.completion_tokens),
        )
        .where(
            EngineChunk.started_at >= since - MAX_CHUNK_SECONDS,
            EngineChunk.ended_at > since,
        )
        .group_by(EngineChunk.model, EngineChunk.worker_id, EngineChunk.device)
    )
    if worker_id is not None:
        query = query.where(EngineChunk.worker_id == worker_id)
    if tenant_id is not None:
        query = (
            query.join(EngineChunkBatch, EngineChunkBatch.chunk_id == EngineChunk.id)
            .join(Batch, Batch.id == EngineChunkBatch.batch_id)
            .where(Batch.tenant_id == tenant_id)
        )
    return [
        EngineWindow(
            model, worker, device, float(busy), int(n), int(prompt), int(cached), int(completion)
        )
        for model, worker, device, busy, n, prompt, cached, completion in session.execute(query)
    ]


def throughput_series(
    session: Session, since: float, bucket_seconds: int, tenant_id: str | None = None
) -> list[tuple[int, str, int, int]]:
    """``(bucket start, model, prompt tokens, completion tokens)`` of chunks that ended after
    ``since``, in buckets of ``bucket_seconds`` by their end time; only the tokens of
    ``tenant_id``'s batches if given (their share of each chunk, ``engine_chunk_batches``)."""
    bucket = cast(func.floor(EngineChunk.ended_at / bucket_seconds), Float) * bucket_seconds
    source: Any = EngineChunk if tenant_id is None else EngineChunkBatch
    query = (
        select(
            bucket,
            EngineChunk.model,
            func.sum(source.prompt_tokens),
            func.sum(source.completion_tokens),
        )
        .where(
            EngineChunk.started_at >= since - MAX_CHUNK_SECONDS,
            EngineChunk.ended_at > since,
        )
        .group_by(bucket, EngineChunk.model)
        .order_by(bucket)
    )
    if tenant_id is not None:
        query = (
            query.join(EngineChunkBatch, EngineChunkBatch.chunk_id == EngineChunk.id)
            .join(Batch, Batch.id == EngineChunkBatch.batch_id)
            .where(Batch.tenant_id == tenant_id)
        )
    return [(int(b), model, int(p), int(c)) for b, model, p, c in session.execute(query)]


def scheduler_state(session: Session) -> dict[str, Any]:
    """The ``paused``, ``paused:<pool>``, ``load:<pool>`` and ``replicas:<model>`` entries of
    ``scheduler_state``:
    key → value (read them with ``offpeak.scheduler_state``)."""
    rows = session.execute(
        select(SchedulerState.key, SchedulerState.value).where(
            or_(
                SchedulerState.key == PAUSE_ALL_KEY,
                SchedulerState.key.startswith(PAUSE_PREFIX),
                SchedulerState.key.startswith(LOAD_PREFIX),
                SchedulerState.key.startswith(REPLICAS_PREFIX),
            )
        )
    )
    return {key: value for key, value in rows}


def add_load_samples(session: Session, samples: Iterable[dict[str, Any]]) -> None:
    """Insert ``{at, source, load, paused}`` rows."""
    rows = list(samples)
    if rows:
        session.execute(insert(LoadSample), rows)


def prune_load_samples(session: Session, before: float) -> int:
    result = session.execute(delete(LoadSample).where(LoadSample.at < before))
    return int(getattr(result, "rowcount", 0) or 0)


def load_series(session: Session, since: float) -> list[tuple[float, str, float, bool]]:
    """``(at, source, load, paused)`` samples taken after ``since``, oldest first."""
    rows = session.execute(
        select(LoadSample.at, LoadSample.source, LoadSample.load, LoadSample.paused)
        .where(LoadSample.at > since)
        .order_by(LoadSample.at)
    )
    return [(float(at), source, float(load), bool(paused)) for at, source, load, paused in rows]
