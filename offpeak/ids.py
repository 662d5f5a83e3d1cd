"""Identifiers in OpenAI's shapes (``file-…``, ``batch_…``, ``batch_req_…``), worker ids and
clocks."""

from __future__ import annotations

import os
import secrets
import socket
import time


def new_id(prefix: str) -> str:
    """``prefix`` + 13 hex digits of the creation time in microseconds + 11 random hex digits.

    Ids of one prefix therefore sort in creation order, which list pagination relies on
    (``ORDER BY id``, ``after=<id>``), as ULIDs do.
    """
    return f"{prefix}{time.time_ns() // 1000:013x}{secrets.token_hex(6)[:11]}"


def new_ids(*prefixes: str) -> list[str]:
    """One ``new_id`` per prefix, made together: one clock reading and one read of the OS's
    random source for all of them (a finished line takes three ids; ``secrets`` per id was a
    third of building its record)."""
    stamp = f"{time.time_ns() // 1000:013x}"
    random = os.urandom(6 * len(prefixes)).hex()
    return [f"{p}{stamp}{random[12 * i : 12 * i + 11]}" for i, p in enumerate(prefixes)]


def now() -> int:
    """Unix seconds, as the API shows times."""
    return int(time.time())


_worker_ids: dict[int, str] = {}


def worker_id() -> str:
    """``host:pid:random``, fixed for this process: readable in the leases a worker writes and
    in ``/healthz``, and unique per start (a container restarted with the same hostname and PID
    1 must not adopt its dead predecessor's leases). A forked child gets an id of its own."""
    pid = os.getpid()
    if pid not in _worker_ids:
        _worker_ids[pid] = f"{socket.gethostname()}:{pid}:{secrets.token_hex(3)}"
    return _worker_ids[pid]
