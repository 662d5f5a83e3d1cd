"""Dead rows and ``VACUUM`` on PostgreSQL, for the sweep's vacuum (``workers.vacuum``).

Every function takes a connection in autocommit: ``VACUUM`` cannot run inside a transaction.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, text


@dataclass(frozen=True)
class TableRows:
    """One table of the current schema: its live and dead rows, as the server's statistics
    count them (``pg_stat_user_tables``), and its own ``autovacuum_vacuum_threshold`` and
    ``autovacuum_vacuum_scale_factor`` where its storage parameters set them."""

    table: str
    live: int
    dead: int
    threshold: int | None = None
    scale_factor: float | None = None


@dataclass(frozen=True)
class AutovacuumRule:
    """When the server's autovacuum would vacuum a table: once its dead rows pass
    ``threshold + scale_factor × live rows`` (PostgreSQL's ``autovacuum_vacuum_threshold`` and
    ``autovacuum_vacuum_scale_factor``, "The Autovacuum Daemon" in its manual); ``on``: whether
    the server runs it."""

    on: bool
    threshold: int
    scale_factor: float

    def due(self, rows: TableRows) -> bool:
        """Whether ``rows``' table is past the rule, its own parameters before the server's."""
        threshold = self.threshold if rows.threshold is None else rows.threshold
        scale = self.scale_factor if rows.scale_factor is None else rows.scale_factor
        return rows.dead > threshold + scale * rows.live


def autovacuum_rule(conn: Connection) -> AutovacuumRule:
    """The server's autovacuum settings."""
    on, threshold, scale = conn.execute(
        text(
            "SELECT current_setting('autovacuum') = 'on', "
            "current_setting('autovacuum_vacuum_threshold')::integer, "
            "current_setting('autovacuum_vacuum_scale_factor')::float8"
        )
    ).one()
    return AutovacuumRule(bool(on), int(threshold), float(scale))


def table_rows(conn: Connection) -> list[TableRows]:
    """Every table of the current schema with its live and dead rows and its own autovacuum
    parameters."""
    rows = conn.execute(
        text(
            "SELECT s.relname, s.n_live_tup, s.n_dead_tup, "
            "(SELECT split_part(o, '=', 2) FROM unnest(c.reloptions) AS o "
            " WHERE o LIKE 'autovacuum_vacuum_threshold=%') AS threshold, "
            "(SELECT split_part(o, '=', 2) FROM unnest(c.reloptions) AS o "
            " WHERE o LIKE 'autovacuum_vacuum_scale_factor=%') AS scale_factor "
            "FROM pg_stat_user_tables AS s JOIN pg_class AS c ON c.oid = s.relid "
            "WHERE s.schemaname = current_schema() ORDER BY s.relname"
        )
    )
    return [
        TableRows(
            str(name),
            int(live),
            int(dead),
            None if threshold is None else int(threshold),
            None if scale is None else float(scale),
        )
        for name, live, dead, threshold, scale in rows
    ]


def vacuum(conn: Connection, table: str) -> None:
    """``VACUUM (ANALYZE, SKIP_LOCKED)`` of ``table``: its dead rows' space and index entries
    become reusable, and its statistics are fresh. It does not block reads or writes; a table
    another ``VACUUM`` holds is skipped rather than waited for."""
    quoted = conn.dialect.identifier_preparer.quote(table)
    conn.exec_driver_sql(f"VACUUM (ANALYZE, SKIP_LOCKED) {quoted}")
