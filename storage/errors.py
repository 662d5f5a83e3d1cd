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


#: SQLSTATEs that say the server will not serve this connection now, though nothing is wrong
#: with the statement: shutting down (``admin_shutdown``, ``crash_shutdown``), starting up or
#: in recovery (``cannot_connect_now``), out of connection slots (``too_many_connections``).
#: Class ``08`` (connection exceptions) counts too. From PostgreSQL's "Appendix A. PostgreSQL
#: Error Codes".
_UNAVAILABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300"})


def is_unavailable(error: BaseException) -> bool:
    """Whether ``error`` means the database cannot be reached right now (an API request answers
    503 and the client retries), narrower than ``is_transient``:

    - the pool's ``TimeoutError``: no connection free within its ``pool_timeout``;
    - a ``DBAPIError`` SQLAlchemy saw drop its connection (``connection_invalidated``);
    - a psycopg ``OperationalError`` without a SQLSTATE (raised by the client: the connection
      was refused, timed out or closed; not ``PipelineAborted``, which follows an earlier
      error), or with one of class ``08`` or ``_UNAVAILABLE_SQLSTATES``. SQLAlchemy does not mark
      a failed connect as invalidated (its psycopg dialect's ``is_disconnect`` needs a
      connection), so a refused connection is recognized here.

    Not a deadlock, a serialization failure, a lock or statement timeout (a statement lost a
    race or ran long: the code must handle those where they can happen), nor any error that
    says a statement is wrong (``IntegrityError``, ``ProgrammingError``, ``DataError``), nor a
    bare ``InterfaceError`` (psycopg raises it for a closed cursor or an unknown type: a bug).
    SQLite's "database is locked" is not recognized either.
    """
    if isinstance(error, sa_exc.TimeoutError):
        return True
    driver_error: BaseException | None = error
    if isinstance(error, sa_exc.DBAPIError):
        if error.connection_invalidated:
            return True
        driver_error = error.orig
    if not isinstance(driver_error, psycopg.OperationalError):
        return False
    if isinstance(driver_error, psycopg.errors.PipelineAborted):
        return False
    state = driver_error.sqlstate
    return state is None or state.startswith("08") or state in _UNAVAILABLE_SQLSTATES
