"""Engines and sessions.

Sessions are opened by the caller (an HTTP dependency or a task) with ``session_scope``: it
commits on success and rolls back on error; services and repositories only ``flush()``.
``read`` runs a read-only function on a connection of its own, for the API's status polls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, TypeVar

import orjson
import psycopg
from sqlalchemy import (
    JSON,
    Connection,
    Engine,
    Float,
    Integer,
    Numeric,
    Select,
    String,
    create_engine,
    event,
)
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from offpeak.settings import get_settings

log = logging.getLogger(__name__)
T = TypeVar("T")
#: What a query runs on: a session (ORM objects and Core rows) or a connection (Core rows).
Executor = Session | Connection


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    """One pooled engine per database URL for the process, sized by ``database_pool``."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):  # type: ignore[no-untyped-def]
            # WAL lets the API read while a worker writes; foreign keys are off by default.
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    pool = get_settings().database_pool
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=pool.size,
        max_overflow=pool.overflow,
        connect_args=connect_args(url),
    )


#: Seconds a new PostgreSQL connection may take before it fails (libpq's ``connect_timeout``,
#: none by default): a server that does not answer (a host gone, a network partition, a hung
#: server that took the TCP connection) then gives an ``OperationalError`` — the API's 503, a
#: worker's transient error — in seconds, rather than after the kernel's SYN retries (≈ 2
#: minutes on Linux) or never, with a request thread held the whole time.
CONNECT_TIMEOUT_SECONDS = 10


#: libpq's TCP keepalives and user timeout: a connection whose server, or the network to it,
#: vanished (a host cut off: nothing closes the connection) is found dead in about a minute,
#: rather than a thread blocked in ``recv`` for the kernel's two hours of keepalive idle.
DEAD_PEER_ARGS = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,  # milliseconds sent data may stay unacknowledged
}


def connect_args(url: str) -> dict[str, Any]:
    """The ``connect_args`` of every engine on ``url`` (the pools here, the migrations'):
    for PostgreSQL ``CONNECT_TIMEOUT_SECONDS`` as psycopg's ``connect_timeout`` and
    ``DEAD_PEER_ARGS``, unless the URL sets its own (``?connect_timeout=…`` wins), and no
    prepared statements where ``database_pool.prepared_statements`` is off (psycopg's
    ``prepare_threshold=None``); nothing for another database."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        return {}
    defaults = {"connect_timeout": CONNECT_TIMEOUT_SECONDS, **DEAD_PEER_ARGS}
    args: dict[str, Any] = {k: v for k, v in defaults.items() if k not in parsed.query}
    if not get_settings().database_pool.prepared_statements:
        args["prepare_threshold"] = None
    return args


@lru_cache(maxsize=8)
def get_sessionmaker(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


@lru_cache(maxsize=8)
def get_read_engine(url: str) -> Engine:
    """The process's pool for ``read``: autocommit, no pre-ping (PostgreSQL; SQLite shares
    ``get_engine``'s, in autocommit).

    Autocommit: no ``BEGIN``/``COMMIT`` round trips. Under PostgreSQL's READ COMMITTED (the
    default, and ours) each statement of a transaction sees what was committed before that
    statement began, which is what each autocommit statement sees: a read-only function reads
    the same rows either way. No pre-ping: its ``SELECT 1`` was one more round trip per
    request; ``read`` runs a function again when its connection turned out dead instead.
    ``database_pool.read_size`` connections (20) kept open and no overflow: an overflow
    connection is closed when it is returned to a full pool, so under more concurrent polls than
    the pool holds every request paid for a new connection (a server process forked and
    authenticated) where it should wait for a free one. 20 a process keeps two API processes and
    the workers within PostgreSQL's default ``max_connections`` (100). JSON columns are parsed
    by orjson (``_loads``).
    """
    if url.startswith("sqlite"):
        return get_engine(url).execution_options(isolation_level="AUTOCOMMIT")
    return create_engine(
        url,
        isolation_level="AUTOCOMMIT",
        pool_size=get_settings().database_pool.read_size,
        max_overflow=0,
        json_deserializer=_loads,
        connect_args=connect_args(url),
    )


def _loads(text: str | bytes) -> Any:
    """JSON columns on the read path: orjson parses a list page's 60 JSON values in a fraction
    of ``json.loads``' time. The values are the same but for integers beyond 64 bits, which it
    reads as floats; no column holds one (token counts, line numbers)."""
    return orjson.loads(text)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session that commits when the block succeeds and rolls back when it raises."""
    session = get_sessionmaker(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def read(url: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(connection, *args, **kwargs)`` on a read-only autocommit connection of
    ``get_read_engine``'s pool: Core statements, rows rather than ORM objects (a session and
    ORM loading cost a status poll more than its statement; docs/benchmarks.md, "Status polls").

    ``fn`` must only read: in autocommit a write would commit at once, statement by statement,
    and no ``after_commit`` callback runs. Where the pool's connection was dead (the database
    restarted since it was last used: what ``pool_pre_ping`` guards against elsewhere), the
    pool is invalidated and ``fn`` runs once more on a new connection: it only read, so running
    it again is safe. Raises what ``fn`` raises, and ``DBAPIError`` for anything else.
    """
    engine = get_read_engine(url)
    for attempt in (1, 2):
        try:
            with engine.connect() as connection:
                return fn(connection, *args, **kwargs)
        except DBAPIError as exc:
            if attempt == 2 or not exc.connection_invalidated:
                raise
    raise AssertionError("unreachable")


def _driver_typed(column_type: Any) -> bool:
    """Whether psycopg returns this column type's values as SQLAlchemy would, with no result
    processing: strings, integers, JSON (parsed by the dialect's deserializer, set on each
    connection), ``Float`` as float and ``Numeric`` as ``Decimal``."""
    if isinstance(column_type, Float):  # a Numeric too
        return not column_type.asdecimal
    if isinstance(column_type, Numeric):
        return bool(column_type.asdecimal)
    return isinstance(column_type, String | Integer | JSON)


class PollQuery:
    """A select that status polls run (``storage.repositories``' ``poll_row`` and ``poll_page``),
    built once; it answers rows as dicts of its columns by key (what ``Row._asdict()`` gives).

    On PostgreSQL it runs on the driver's cursor, as SQL compiled once: SQLAlchemy's execution
    (compiled cache, execution context, result metadata from the cursor's description of 33
    columns) cost a retrieve more CPU than psycopg's own execution (docs/benchmarks.md, "Status
    polls"). A driver error is still raised as SQLAlchemy raises it (``DBAPIError``, ``DataError``
    for a NUL character), and a dropped connection is invalidated, so ``read``'s retry and the
    API's 400 work as on any statement. Elsewhere (SQLite, a session), and for a select with a
    column of another type or parameters compiled late, it runs through SQLAlchemy."""

    def __init__(self, query: Select[Any]) -> None:
        self.query = query
        self.keys = tuple(query.selected_columns.keys())
        keys = self.keys

        def make_dict(values: Any) -> dict[str, Any]:
            return dict(zip(keys, values, strict=True))

        self._row_factory = lambda _cursor: make_dict
        self._compiled: dict[Dialect, tuple[str, dict[str, Any]] | None] = {}

    def _driver_sql(self, dialect: Dialect) -> tuple[str, dict[str, Any]] | None:
        """The SQL and its literals' parameters for psycopg (compiled once per dialect), or
        ``None`` where SQLAlchemy must run it."""
        if dialect in self._compiled:
            return self._compiled[dialect]
        compiled = None
        if dialect.driver == "psycopg" and not dialect.is_async:
            statement = self.query.compile(dialect=dialect)
            typed = all(_driver_typed(column.type) for column in self.query.selected_columns)
            if typed and "POSTCOMPILE" not in statement.string and not statement.positional:
                literals = {
                    name: bind.value
                    for bind, name in statement.bind_names.items()
                    if not bind.required
                }
                compiled = (statement.string, literals)
        self._compiled[dialect] = compiled
        return compiled

    def all(self, db: Executor, params: dict[str, Any]) -> list[dict[str, Any]]:
        if isinstance(db, Connection):
            compiled = self._driver_sql(db.dialect)
            if compiled is not None:
                return self._on_cursor(db, compiled[0], {**compiled[1], **params})
        return [row._asdict() for row in db.execute(self.query, params)]

    def first(self, db: Executor, params: dict[str, Any]) -> dict[str, Any] | None:
        rows = self.all(db, params)
        return rows[0] if rows else None

    def _on_cursor(self, db: Connection, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        try:
            driver = db.connection.driver_connection
            assert driver is not None
            with driver.cursor(row_factory=self._row_factory) as cursor:
                cursor.execute(sql, params)
                rows: list[dict[str, Any]] = cursor.fetchall()
                return rows
        except db.dialect.loaded_dbapi.Error as exc:
            # SQLAlchemy's own handling of a driver error (what ``execute`` does): wraps it,
            # and invalidates the connection when the error says it was dropped.
            db._handle_dbapi_exception(exc, sql, params, None, None)
            raise  # not reached: the call above raises


def is_postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def driver_connection(session: Session) -> psycopg.Connection[Any]:
    """The psycopg connection under the session's transaction (for ``COPY``, binary parameters
    and pipelines, which SQLAlchemy does not expose). PostgreSQL only."""
    raw = session.connection().connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    return raw


def after_commit(session: Session, callback: Callable[[], None], what: str = "") -> None:
    """Run ``callback`` once this session's transaction commits; drop it if it rolls back.

    Used to send a task only when the rows it reads are visible to the worker. A callback that
    raises is logged and skipped, never raised: the transaction has committed, so the caller's
    work is done (an HTTP client must get its answer, not a 500 that makes it retry and create
    the batch twice). Only send what the periodic sweep (``workers.tasks.sweep``) would send
    again from the rows. ``what`` names the step in that log line (e.g. ``"validate batch_…"``).
    """
    session.info.setdefault("after_commit", []).append((callback, what))


@event.listens_for(Session, "after_commit")
def _run_after_commit(session: Session) -> None:
    for callback, what in session.info.pop("after_commit", []):
        try:
            callback()
        except Exception:
            # e.g. the broker is down: the rows say what is owed, and the sweep re-sends it.
            log.exception("after commit: %s failed; the sweep re-sends it", what or callback)


@event.listens_for(Session, "after_rollback")
def _drop_after_commit(session: Session) -> None:
    session.info.pop("after_commit", None)
