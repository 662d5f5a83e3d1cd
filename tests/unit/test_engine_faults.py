"""Fault rules that need no database: worker ids unique per start, transient database errors told
from wrong statements."""

from __future__ import annotations

import os

import psycopg
from sqlalchemy.exc import IntegrityError

from storage.errors import is_transient
from workers.runner import worker_id


def test_worker_ids_are_unique_per_start() -> None:
    """``host:pid`` repeats after a container restart (PID 1, same hostname)."""
    mine = worker_id()
    assert worker_id() == mine, "stable within a process"
    host, pid, suffix = mine.split(":")
    assert pid == str(os.getpid()) and len(suffix) == 6
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a forked child (prefork pool) is another worker
        os.write(write, worker_id().encode())
        os._exit(0)
    os.waitpid(child, 0)
    assert os.read(read, 200).decode() != mine
    # A new process with the same pid and host (simulated: forget this process's id).
    from offpeak import ids

    ids._worker_ids.clear()
    try:
        assert worker_id() != mine
    finally:
        ids._worker_ids[os.getpid()] = mine


def test_transient_database_errors_are_told_from_wrong_statements() -> None:
    assert is_transient(psycopg.OperationalError("server closed the connection"))
    from sqlalchemy.exc import OperationalError

    assert is_transient(OperationalError("SELECT 1", {}, Exception("database is locked")))
    assert not is_transient(IntegrityError("INSERT", {}, Exception("duplicate key")))
    assert not is_transient(psycopg.errors.DataError("invalid input"))
    assert not is_transient(psycopg.ProgrammingError("syntax error"))
