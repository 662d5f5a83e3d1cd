"""A request line's end as the runner records it (``FinishedLine``): answered, failed alone, or
stopped before it ran. Its ``result`` is the neutral record (``offpeak.endpoints.records``) that
finalize renders as the output or error line; this module adds the line's token counts.

An answered line is first an ``Answered``: the engine's result and the line's token counts,
whose record is built (``Answered.line``) when it is written back, on the write-back thread for
the periodic write (``workers.runner.write_back``), so that its cost does not come out of the
engine's steps (``offpeak bench overhead``).
"""

from __future__ import annotations

from dataclasses import dataclass

from offpeak.endpoints import records
from offpeak.statuses import LineStatus
from storage.repositories.requests import ClaimedRequest, FinishedLine, TokenCounts
from workers import engine_io
from workers.engine.base import EngineResult
from workers.engine_io import LineError, Prepared


def succeeded(
    row: ClaimedRequest, prepared: Prepared, result: EngineResult, created: int, at: float
) -> FinishedLine:
    """The record of an answered request; ``created`` (unix seconds) goes in its body."""
    return _succeeded(row, prepared, result, created, at, _tokens(result))


def _succeeded(
    row: ClaimedRequest,
    prepared: Prepared,
    result: EngineResult,
    created: int,
    at: float,
    tokens: TokenCounts,
) -> FinishedLine:
    return FinishedLine(
        id=row.id,
        batch_id=row.batch_id,
        status=LineStatus.SUCCEEDED,
        finished_at=at,
        status_code=200,
        result=engine_io.answer_record(prepared, result, created),
        tokens=tokens,
    )


def _tokens(result: EngineResult) -> TokenCounts:
    """The line's token counts as its record has them (``Answer.completion_tokens``)."""
    completion = sum(len(c.token_ids) for c in result.completions)
    return TokenCounts(result.prompt_tokens, result.cached_tokens, completion)


@dataclass(frozen=True)
class Answered:
    """An answered line whose record is not built yet: what ``succeeded`` needs, and the token
    counts (the engine's, as ``succeeded`` records them) that the runner's totals and the
    write-back's accounting read before it is. ``finished_at``: unix seconds; ``created``:
    unix seconds for the output body."""

    row: ClaimedRequest
    prepared: Prepared
    result: EngineResult
    created: int
    finished_at: float
    tokens: TokenCounts
    #: ``held_bytes`` of this line, counted once when it is answered (the write-back adds it
    #: when the line is held and takes it off when it is stored).
    held: int

    #: What ``engine_chunks.tokens_by_batch`` and the write-back read of a ``FinishedLine``.
    status = LineStatus.SUCCEEDED

    @property
    def id(self) -> int:
        return self.row.id

    @property
    def batch_id(self) -> str:
        return self.row.batch_id

    def line(self) -> FinishedLine:
        """The ``FinishedLine`` to store (``succeeded``, with the token counts already made)."""
        return _succeeded(
            self.row, self.prepared, self.result, self.created, self.finished_at, self.tokens
        )


#: A finished line as the runner holds it until it is stored.
Finished = FinishedLine | Answered


def answered(
    row: ClaimedRequest, prepared: Prepared, result: EngineResult, created: int, at: float
) -> Answered:
    """An answered request, its record built later (``Answered.line``)."""
    return Answered(row, prepared, result, created, at, _tokens(result), _answer_bytes(row, result))


def held_bytes(line: Finished) -> int:
    """What holding ``line`` until it is stored costs, in bytes of its payload: the request
    line as claimed, the completions' text and token ids (8 bytes an id) and an embeddings
    line's vectors (``Answered.held``), or a built record's JSON. A proxy for its memory
    (Python's objects add a constant share), for the write-back's bound
    (``workers.runner.loop.MAX_HELD_BYTES``)."""
    if isinstance(line, FinishedLine):
        return len(line.result or "")
    return line.held


def _answer_bytes(row: ClaimedRequest, result: EngineResult) -> int:
    size = len(row.line_json)
    for completion in result.completions:
        size += len(completion.text) + 8 * len(completion.token_ids)
    if result.embeddings:
        size += sum(len(vector) for vector in result.embeddings)
    return size


def stored(line: Finished) -> FinishedLine:
    """``line`` as ``requests_repo.write_results`` stores it (its record built if not yet)."""
    return line.line() if isinstance(line, Answered) else line


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
