"""A batch's results while it runs (``GET /v1/batches/{id}/results``, an Offpeak extension):
its ended lines so far, each exactly as the output or error file will hold it, a page at a
time in a stable order (``storage.repositories.results``)."""

from __future__ import annotations

from api.errors import BadRequest, NotFound, unknown_cursor
from offpeak.endpoints import anthropic_messages
from offpeak.endpoints.batch_lines import batch_line
from storage.db import Executor
from storage.repositories import batches as batches_repo
from storage.repositories import results as results_repo

#: A page's most lines (OpenAI's lists stop at 100; a results page is read to download a batch
#: of up to 50,000 lines, so it may be longer) and its default.
MAX_LIMIT = 1000
DEFAULT_LIMIT = 100


def page(db: Executor, tenant_id: str, batch_id: str, *, after: str | None, limit: int) -> bytes:
    """A page of the batch's ended lines after the line whose ``id`` is ``after``, as
    OpenAI's list JSON (``{"object": "list", "data": [lines], "first_id", "last_id",
    "has_more"}``), built from the lines' bytes without parsing them again. ``has_more``: more
    lines are readable now (while the batch runs, more may end later). Read-only; holds at most
    ``limit + 1`` rows.

    Raises ``NotFound`` for an unknown or another tenant's batch, ``BadRequest`` for a bad
    ``limit`` or an ``after`` that names no ended line of the batch (``unknown_cursor``)."""
    if not 1 <= limit <= MAX_LIMIT:
        raise BadRequest(f"limit must be between 1 and {MAX_LIMIT}.", param="limit")
    row = batches_repo.poll_row(db, tenant_id, batch_id)
    if row is None or row["endpoint"] == anthropic_messages.URL:
        raise NotFound(f"No batch found with id '{batch_id}'.", param="batch_id")
    cursor = None
    if after:
        cursor = results_repo.cursor_of(db, batch_id, after)
        if cursor is None:
            raise unknown_cursor("result line", after)
    rows = results_repo.page(db, batch_id, cursor, limit + 1)
    lines = []
    for ended in rows[:limit]:
        line = batch_line(batch_id, ended.custom_id, ended.status, ended.result)
        if line is not None:
            lines.append(line)
    return b"".join(
        (
            b'{"object":"list","data":[',
            b",".join(line.json for line in lines),
            b'],"first_id":',
            _json_id(lines[0].id if lines else None),
            b',"last_id":',
            _json_id(lines[-1].id if lines else None),
            b',"has_more":',
            b"true" if len(rows) > limit else b"false",
            b"}",
        )
    )


def _json_id(line_id: str | None) -> bytes:
    # Line ids are ``batch_req_`` and hex digits: nothing to escape.
    return b"null" if line_id is None else b'"' + line_id.encode() + b'"'
