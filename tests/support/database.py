"""Throwaway databases on the machine's PostgreSQL (``OFFPEAK_TEST_PG``), settings read from a
test environment, API keys of new tenants, and request rows to insert directly."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from offpeak.settings import Settings
from offpeak.statuses import LineStatus
from offpeak.tenant_limits import LIMIT_NAMES, UNLIMITED_WORD

#: The server the throwaway databases are made on, as its superuser.
PG_ADMIN = os.environ.get("OFFPEAK_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
#: Every tenant limit off: the suite's tests create batches and poll in bursts from one key,
#: which the default limits would refuse. The tests of the limits set the ones they test.
LIMITS_OFF = {f"OFFPEAK_LIMITS__{name.upper()}": UNLIMITED_WORD for name in LIMIT_NAMES}


@contextmanager
def fresh_database(name: str) -> Iterator[str]:
    """A new PostgreSQL database built by the Alembic migrations (a copy of this process's
    migrated template, ``migrated_template``); dropped afterwards. Yields its SQLAlchemy URL;
    raises ``psycopg.OperationalError`` when the server does not answer."""
    import psycopg

    template = migrated_template()
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    try:
        yield database_url(name)
    finally:
        from storage.db import get_engine

        get_engine.cache_clear()
        drop_database(name)


def database_url(name: str) -> str:
    """The SQLAlchemy URL of database ``name`` on the test server."""
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


def drop_database(name: str) -> None:
    """Drop database ``name`` (if it exists), closing its sessions."""
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


_template: str | None = None


def migrated_template() -> str:
    """The name of a database the Alembic migrations built once for this process, which
    ``fresh_database`` copies (PostgreSQL's ``CREATE DATABASE … TEMPLATE``: a file copy, rather
    than every migration again for each of the suite's throwaway databases). The session drops
    it at its end (``drop_migrated_template``)."""
    global _template
    if _template is None:
        import psycopg

        import migrations

        name = f"offpeak_template_{os.getpid()}_{secrets.token_hex(3)}"
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        try:
            # Migrations connect without a pool: no session is left on it to block a copy.
            migrations.upgrade(database_url(name))
        except BaseException:
            drop_database(name)
            raise
        _template = name
    return _template


def drop_migrated_template() -> None:
    """Drop this process's migrated template, if it made one."""
    global _template
    name, _template = _template, None
    if name is not None:
        drop_database(name)


def settings_from(env: dict[str, str]) -> Settings:
    """``Settings`` as a process started with ``env`` reads them; this process's environment is
    left as it was."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return Settings()
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def new_key(settings: Settings, tenant: str | None = None) -> str:
    """An API key of ``tenant`` (a new tenant when None), stored in the settings' database."""
    from api.services import keys
    from storage.db import session_scope

    with session_scope(settings.resolved_database_url) as session:
        return keys.create_key(session, tenant or f"tenant-{secrets.token_hex(4)}")


def request_row(batch_id: str, line: int, deadline: int, **changes: Any) -> dict[str, Any]:
    """A pending ``requests`` row of model ``m`` (``custom_id`` ``r<line>``), for an insert of
    many rows at once; ``changes`` replace its columns."""
    return {
        "batch_id": batch_id,
        "line": line,
        "custom_id": f"r{line}",
        "model": "m",
        "deadline": deadline,
        "line_json": "{}",
        "status": LineStatus.PENDING,
        "attempts": 0,
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "completion_tokens": 0,
    } | changes
