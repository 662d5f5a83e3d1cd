"""Task messages sent and not yet started (``TaskMessage``, the ``queued_messages`` table): at
most one recorded per key, so the tasks that re-send work (the sweep, a finalize waiting for its
lines, every validated batch) do not pile up duplicates in the broker. Kept in the database
because the broker may be Redis or the embedded transport, and only the database is shared by
every process on both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, case, delete
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from storage.models import TaskMessage


def _insert(session: Session) -> Any:
    """The dialect's ``INSERT`` construct, which has ``on_conflict_do_update``."""
    return (postgresql if session.get_bind().dialect.name == "postgresql" else sqlite).insert


def reserve(
    session: Session,
    keys: Sequence[str],
    *,
    mark: str,
    now: float,
    due_at: float,
    wait_seconds: float,
    max_wait_seconds: float,
    sooner: bool,
) -> list[str]:
    """Record a message about to be sent for each of ``keys``; return the keys to send.

    A key is sent when no message is recorded for it, or the recorded one is lost (``now`` is at
    or past its ``resend_at``), or, with ``sooner``, the recorded one becomes runnable only after
    ``due_at`` (a countdown this message must overtake). Every key returned now carries ``mark``;
    a lost key's wait doubles, up to ``max_wait_seconds``, so a message no worker takes (none
    running, or all busy with a long drain) is re-sent ever more rarely, never stuck.

    One ``INSERT … ON CONFLICT DO UPDATE … WHERE … RETURNING`` (batched by SQLAlchemy's
    "insertmanyvalues"), on PostgreSQL and SQLite alike, so concurrent senders of one key agree:
    one of them sends. Its shape is fixed (values are parameters), so it compiles once.
    ``now``, ``due_at`` are unix seconds; waits are seconds.
    """
    if not keys:
        return []
    table = TaskMessage.__table__
    statement = _insert(session)(table)
    new = statement.excluded
    lost = table.c.resend_at <= new.sent_at
    doubled = case(
        (table.c.wait_seconds * 2 > max_wait_seconds, max_wait_seconds),
        else_=table.c.wait_seconds * 2,
    )
    wait = case((lost, doubled), else_=table.c.wait_seconds)
    when: ColumnElement[bool] = lost
    if sooner:
        when = lost | (table.c.due_at > new.due_at)
    statement = statement.on_conflict_do_update(
        index_elements=[table.c.key],
        set_={
            "mark": new.mark,
            "sent_at": new.sent_at,
            "due_at": new.due_at,
            "wait_seconds": wait,
            "resend_at": new.due_at + wait,
        },
        where=when,
    ).returning(table.c.key)
    rows = [
        {
            "key": key,
            "mark": mark,
            "sent_at": now,
            "due_at": due_at,
            "wait_seconds": wait_seconds,
            "resend_at": due_at + wait_seconds,
        }
        for key in keys
    ]
    return list(session.connection().execute(statement, rows).scalars())


def release(session: Session, keys: Sequence[str], mark: str) -> int:
    """Forget the messages of ``keys`` that carry ``mark`` (the task started, or the message was
    never sent); a newer message's record stays. Returns the rows deleted."""
    if not keys:
        return 0
    result = session.execute(
        delete(TaskMessage)
        .where(TaskMessage.key.in_(list(keys)), TaskMessage.mark == mark)
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def purge(session: Session, before: float) -> int:
    """Delete records lost since before ``before`` (unix seconds): no sender asked again, so the
    work they were for has ended. A lost record allows a send anyway; this only keeps the table
    small. Returns the rows deleted."""
    result = session.execute(
        delete(TaskMessage)
        .where(TaskMessage.resend_at < before)
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)
