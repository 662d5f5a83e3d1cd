"""A request line's end as the runner records it (``FinishedLine``): answered, failed alone, or
stopped before it ran. Its ``result`` is the neutral record (``offpeak.endpoints.records``) that
finalize renders as the output or error line; this module adds the line's token counts."""

from __future__ import annotations

from offpeak.endpoints import records
from offpeak.statuses import LineStatus
from storage.repositories.requests import ClaimedRequest, FinishedLine, TokenCounts
from workers import serving
from workers.engine.base import EngineResult
from workers.serving import LineError, Prepared


def succeeded(
    row: ClaimedRequest, prepared: Prepared, result: EngineResult, created: int, at: float
) -> FinishedLine:
    """The record of an answered request; ``created`` (unix seconds) goes in its body."""
    answer = serving.answer(prepared, result, created)
    return FinishedLine(
        id=row.id,
        batch_id=row.batch_id,
        status=LineStatus.SUCCEEDED,
        finished_at=at,
        status_code=200,
        result=records.dump(answer),
        tokens=TokenCounts(
            prompt=answer.prompt_tokens,
            cached=answer.cached_tokens,
            completion=answer.completion_tokens,
        ),
    )


def failed(row: ClaimedRequest, error: LineError, at: float) -> FinishedLine:
    """The record of a request that failed alone (``error.status_code``)."""
    return FinishedLine(
        id=row.id,
        batch_id=row.batch_id,
        status=LineStatus.FAILED,
        finished_at=at,
        status_code=error.status_code,
        result=records.dump(records.failure(error)),
    )


def never_ran(row: ClaimedRequest, status: str, at: float) -> FinishedLine:
    """A line stopped with its batch (``cancelled`` or ``expired``); finalize writes its line."""
    return FinishedLine(id=row.id, batch_id=row.batch_id, status=status, finished_at=at)


def crashed_engine(failures: int) -> LineError:
    """The error of a poison line: inside ``failures`` engine failures, alone among retried
    lines since the first (``Settings.max_line_attempts``)."""
    return LineError(
        f"The engine failed {failures} times while running this request, alone among retried "
        "requests since the first failure; it was not run again.",
        code="engine_failure",
        status_code=500,
    )


def internal_error() -> LineError:
    """The error of a line our own code could not prepare (a bug, not the client's fault)."""
    return LineError(
        "The server failed to process this request; it was not run.",
        code="internal_error",
        status_code=500,
    )
