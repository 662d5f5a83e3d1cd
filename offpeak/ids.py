"""Identifiers in OpenAI's shapes (``file-…``, ``batch_…``, ``batch_req_…``), worker ids and
clocks."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time


def new_id(prefix: str) -> str:
    """``prefix`` + 13 hex digits of the creation time in microseconds + 11 random hex digits.

    Ids of one prefix therefore sort in creation order, which list pagination relies on
    (``ORDER BY id``, ``after=<id>``), as ULIDs do.
    """
    return f"{prefix}{time.time_ns() // 1000:013x}{secrets.token_hex(6)[:11]}"


def new_ids(*prefixes: str) -> list[str]:
    """One ``new_id`` per prefix, made together: one clock reading for all of them, their
    random digits from the OS's random source read ahead (``_random_hex``). A finished line
    takes three ids: a ``secrets`` call per id was a third of building its record, and a
    system call per line on the runner's write-back thread waited for the GIL each time."""
    stamp = f"{time.time_ns() // 1000:013x}"
    digits = _random_hex(11 * len(prefixes))  # one read of the pool for all of them
    return [f"{p}{stamp}{digits[11 * i : 11 * i + 11]}" for i, p in enumerate(prefixes)]


#: Hex digits read from ``os.urandom`` at a time, per thread (``_random_hex``).
_POOL_HEX = 8192
_pool = threading.local()


def _random_hex(digits: int) -> str:
    """``digits`` random hex digits (at most ``_POOL_HEX``) from this thread's pool of
    ``os.urandom`` bytes, refilled when spent. A forked child starts a pool of its own
    (``_new_pool``), so it never repeats its parent's digits."""
    hex_digits: str = getattr(_pool, "hex", "")
    at: int = getattr(_pool, "at", 0)
    if at + digits > len(hex_digits):
        hex_digits, at = os.urandom(_POOL_HEX // 2).hex(), 0
        _pool.hex = hex_digits
    _pool.at = at + digits
    return hex_digits[at : at + digits]


def _new_pool() -> None:
    global _pool
    _pool = threading.local()


os.register_at_fork(after_in_child=_new_pool)


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
