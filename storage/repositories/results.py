"""A batch's ended lines while it runs, in a stable order, a page at a time
(``GET /v1/batches/{id}/results``).

The order is ``(finished_seq, id)``: keyset paging on ``ix_requests_finished``, so a page costs
the same at any depth of a 1,000,000-line batch and holds at most a page of rows in memory.

A page must never skip a line that ends later: every write that ends lines of a batch takes
the batch's next ``results_seq`` for them under the batch's row lock, held until it commits
(``batches.LOCK_FOR_RESULTS``), so a batch's numbers commit in the order they are taken, and a
line committed after a page was read has a number above every line that page could show.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import Connection, text

from offpeak.endpoints.batch_lines import never_ran_line_id
from storage.db import Executor
from storage.models import STORED_LINE_ID


@dataclass(frozen=True)
class Cursor:
    """A line's place in its batch's results order."""

    finished_seq: int
    id: int


@dataclass(frozen=True)
class EndedRow:
    """An ended request row, as a results page reads it."""

    custom_id: str
    status: str
    result: str | None
    cursor: Cursor


def _postgres(db: Executor) -> bool:
    dialect = db.dialect if isinstance(db, Connection) else db.get_bind().dialect
    return dialect.name == "postgresql"


def _page_sql(after: bool) -> str:
    return (
        "SELECT custom_id, status, result, finished_seq, id FROM requests "
        "WHERE batch_id = :batch_id AND finished_seq IS NOT NULL "
        + ("AND (finished_seq, id) > (:seq, :row_id) " if after else "")
        + "ORDER BY finished_seq, id LIMIT :rows"
    )


def page(db: Executor, batch_id: str, after: Cursor | None, rows: int) -> list[EndedRow]:
    """Up to ``rows`` ended lines of ``batch_id`` after the cursor ``after`` (from the first
    without one), in results order, as far as they are settled (the module's docstring)."""
    params: dict[str, object] = {"batch_id": batch_id, "rows": rows}
    if after is not None:
        params |= {"seq": after.finished_seq, "row_id": after.id}
    found = db.execute(text(_page_sql(after is not None)), params)
    return [EndedRow(r[0], r[1], r[2], Cursor(r[3], r[4])) for r in found]


def cursor_of(db: Executor, batch_id: str, line_id: str) -> Cursor | None:
    """The place of the ended line of ``batch_id`` whose output or error line has ``id``
    ``line_id``; ``None`` when none has (yet).

    A line that ran is found by the id in its stored record (``ix_requests_line_id`` on
    PostgreSQL). One that never ran (cancelled or expired: nothing stored, its id derived from
    its ``custom_id``) is looked for among the batch's rows with nothing stored, read in order
    and streamed: such rows exist only once the batch is ending."""
    postgres = _postgres(db)
    if postgres:
        found = db.execute(
            text(
                "SELECT finished_seq, id FROM requests WHERE batch_id = :batch_id "
                f"AND finished_seq IS NOT NULL AND {STORED_LINE_ID} = :line_id"
            ),
            {"batch_id": batch_id, "line_id": line_id},
        ).first()
    else:
        found = db.execute(
            text(
                "SELECT finished_seq, id FROM requests WHERE batch_id = :batch_id "
                "AND finished_seq IS NOT NULL AND instr(substr(result, 1, 400), :needle) > 0"
            ),
            {"batch_id": batch_id, "needle": f'"line_id":"{line_id}"'},
        ).first()
    if found is not None:
        return Cursor(found[0], found[1])
    for custom_id, cursor in _never_ran(db, batch_id):
        if never_ran_line_id(batch_id, custom_id) == line_id:
            return cursor
    return None


#: Rows a read of the never-ran lines fetches at a time.
_CHUNK = 2000


def _never_ran(db: Executor, batch_id: str) -> Iterator[tuple[str, Cursor]]:
    """The batch's ended rows with nothing stored, in results order, ``_CHUNK`` at a time by
    keyset (the reads users make run in autocommit: no server-side cursor)."""
    after = Cursor(-1, -1)
    while True:
        found = db.execute(
            text(
                "SELECT custom_id, finished_seq, id FROM requests WHERE batch_id = :batch_id "
                "AND finished_seq IS NOT NULL AND result IS NULL "
                "AND (finished_seq, id) > (:seq, :row_id) ORDER BY finished_seq, id LIMIT :rows"
            ),
            {"batch_id": batch_id, "seq": after.finished_seq, "row_id": after.id, "rows": _CHUNK},
        ).all()
        for custom_id, seq, row_id in found:
            yield custom_id, Cursor(seq, row_id)
        if len(found) < _CHUNK:
            return
        after = Cursor(found[-1][1], found[-1][2])
