"""Engine chunks: the accounting periods of engine time and the batches that finished in them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from offpeak.statuses import LineStatus
from storage.models import EngineChunk, EngineChunkBatch
from storage.repositories.requests import FinishedLine


@dataclass
class BatchTokens:
    """Tokens of one batch's requests that finished in a chunk."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


def tokens_by_batch(lines: Iterable[FinishedLine]) -> dict[str, BatchTokens]:
    """Tokens of the answered ``lines``, per batch (failed and never-run lines used none)."""
    per_batch: dict[str, BatchTokens] = {}
    for line in lines:
        if line.status == LineStatus.SUCCEEDED:
            tokens = per_batch.setdefault(line.batch_id, BatchTokens())
            tokens.requests += 1
            tokens.prompt_tokens += line.tokens.prompt
            tokens.cached_tokens += line.tokens.cached
            tokens.completion_tokens += line.tokens.completion
    return per_batch


@dataclass(frozen=True)
class EnginePeriod:
    """The engine time of one write-back: ``worker_id``'s engine of ``model`` on ``device``
    stepped ``busy_seconds`` between ``started_at`` and ``ended_at`` (unix seconds)."""

    worker_id: str
    model: str
    device: str
    started_at: float
    ended_at: float
    busy_seconds: float


#: The engine chunk of the lines a ``requests.RESULTS_CTES`` statement wrote, appended to its
#: ``WITH`` list: one ``engine_chunks`` row when any of them succeeded (failed and never-run
#: lines used no engine time), and one ``engine_chunk_batches`` row per batch with succeeded
#: lines, from ``batches.COUNTERS_CTES``' ``sums``. Only rows actually written count: a line
#: another worker took over is billed (once) by that worker. The chunk's id is a scalar
#: subquery, not a join: the write-back disables nested loops
#: (``requests.RESULTS_PLANNER_SETTINGS``), and the penalty a join then carries in the cost
#: estimate turns on the JIT compiler.
#: Parameters: ``period_params``.
CHUNK_CTES = """
    chunk AS (
        INSERT INTO engine_chunks (worker_id, model, device, started_at, ended_at, busy_seconds,
            requests, prompt_tokens, cached_tokens, completion_tokens)
        SELECT %(worker_id)s, %(model)s, %(device)s, %(started_at)s, %(ended_at)s,
            %(busy_seconds)s, sum(completed), sum(answered_prompt), sum(answered_cached),
            sum(answered_completion)
        FROM sums WHERE completed > 0 HAVING count(*) > 0
        RETURNING id
    ),
    chunk_batches AS (
        INSERT INTO engine_chunk_batches (chunk_id, batch_id, requests, prompt_tokens,
            cached_tokens, completion_tokens)
        SELECT (SELECT id FROM chunk), batch_id, completed, answered_prompt, answered_cached,
            answered_completion
        FROM sums WHERE completed > 0
    )"""


def period_params(period: EnginePeriod) -> dict[str, Any]:
    """``CHUNK_CTES``' parameters."""
    return {
        "worker_id": period.worker_id,
        "model": period.model,
        "device": period.device,
        "started_at": period.started_at,
        "ended_at": period.ended_at,
        "busy_seconds": period.busy_seconds,
    }


def record(
    session: Session,
    *,
    worker_id: str,
    model: str,
    device: str,
    started_at: float,
    ended_at: float,
    busy_seconds: float,
    per_batch: Mapping[str, BatchTokens],
) -> int:
    """Insert one chunk and its per-batch rows; returns the chunk id."""
    totals = BatchTokens()
    for tokens in per_batch.values():
        totals.requests += tokens.requests
        totals.prompt_tokens += tokens.prompt_tokens
        totals.cached_tokens += tokens.cached_tokens
        totals.completion_tokens += tokens.completion_tokens
    # A Core insert, not an ORM object and its flush: nothing reads the object back, and the
    # unit of work costs CPU on the write-back's thread every write.
    chunk_id = (
        session.connection()
        .execute(
            insert(EngineChunk).returning(EngineChunk.id),
            {
                "worker_id": worker_id,
                "model": model,
                "device": device,
                "started_at": started_at,
                "ended_at": ended_at,
                "busy_seconds": busy_seconds,
                "requests": totals.requests,
                "prompt_tokens": totals.prompt_tokens,
                "cached_tokens": totals.cached_tokens,
                "completion_tokens": totals.completion_tokens,
            },
        )
        .scalar_one()
    )
    session.connection().execute(
        insert(EngineChunkBatch),
        [
            {
                "chunk_id": chunk_id,
                "batch_id": batch_id,
                "requests": t.requests,
                "prompt_tokens": t.prompt_tokens,
                "cached_tokens": t.cached_tokens,
                "completion_tokens": t.completion_tokens,
            }
            for batch_id, t in per_batch.items()
        ],
    )
    return chunk_id
