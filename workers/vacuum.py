"""The sweep's vacuum: dead rows cleared where the database server's autovacuum does not.

Every line a batch runs leaves dead row versions behind in ``requests`` (its claim, its result,
its lease renewals each write a new version). PostgreSQL's autovacuum clears them; a server run
with ``autovacuum = off`` never does, and a long drain slows as its claims and write-backs wade
through them (``docs/benchmarks.md``, "Files of any size"). There, with ``vacuum`` at its
default, the control worker's periodic sweep vacuums each table by the server's own autovacuum
rule (``storage.repositories.vacuum.AutovacuumRule``). Nothing runs on SQLite.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy.engine import make_url

from offpeak.settings import Settings
from storage.db import get_engine
from storage.repositories import vacuum as vacuum_repo

log = logging.getLogger(__name__)


def sweep(settings: Settings) -> list[str]:
    """Vacuum the tables past the autovacuum rule when the server's autovacuum is off (and
    ``settings.vacuum`` allows it); returns the tables vacuumed. Errors are logged, not raised:
    the periodic sweep's other work must go on."""
    url = settings.resolved_database_url
    if settings.vacuum == "off" or make_url(url).get_backend_name() != "postgresql":
        return []
    done: list[str] = []
    try:
        with get_engine(url).connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            rule = vacuum_repo.autovacuum_rule(conn)
            if rule.on:
                return []
            for rows in vacuum_repo.table_rows(conn):
                if not rule.due(rows):
                    continue
                started = time.monotonic()
                vacuum_repo.vacuum(conn, rows.table)
                done.append(rows.table)
                log.info(
                    "vacuumed %s (%d dead rows, %d live; the server's autovacuum is off) in %.1f s",
                    rows.table,
                    rows.dead,
                    rows.live,
                    time.monotonic() - started,
                )
    except Exception:
        log.exception("vacuum failed; the next sweep tries again")
    return done
