"""Which database errors are worth retrying.

A worker keeps its results in memory and tries again when the database is *unreachable* (a
restart, a dropped connection, SQLite's "database is locked", a lock or statement timeout); an
error that says a statement is *wrong* (``IntegrityError``, ``DataError``, ``ProgrammingError``)
would fail the same way forever, so it is raised instead of retried. Raw psycopg cursors (COPY,
the ``unnest`` write-back) raise psycopg's own classes, which SQLAlchemy does not wrap.
"""

from __future__ import annotations

import psycopg
from sqlalchemy import exc as sa_exc

#: For ``except`` clauses: the database is unreachable or busy right now; retry later.
#: psycopg's ``OperationalError`` covers its lock-timeout, deadlock and cancelled-query errors.
TRANSIENT_DB_ERRORS: tuple[type[BaseException], ...] = (
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.DisconnectionError,
    sa_exc.TimeoutError,  # the connection pool had no connection to give
    psycopg.OperationalError,
    psycopg.InterfaceError,
)


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` means "try again later" rather than "this statement is wrong": one of
    ``TRANSIENT_DB_ERRORS``, or a ``DBAPIError`` SQLAlchemy saw invalidate its connection."""
    if isinstance(error, TRANSIENT_DB_ERRORS):
        return True
    return isinstance(error, sa_exc.DBAPIError) and bool(error.connection_invalidated)
