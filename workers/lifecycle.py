"""A worker process's stop request, shared by its signal handlers and the runner's loop.

The engine worker's SIGTERM handler calls ``request_stop``; the runner checks ``stop_requested``
every turn of its loop and, once it is set, stops admitting, writes back what finished, hands the
lines it holds back to pending and returns (``DrainStats.outcome == "stopped"``), so the worker
can close its engine and exit. A ``threading.Event``: the heartbeat thread and a signal handler
may set or read it while the loop runs.
"""

from __future__ import annotations

import threading
import time

_stop = threading.Event()
#: ``time.monotonic()`` by which the process must have stopped, if the request set one.
_deadline: float | None = None


def request_stop(within: float | None = None) -> None:
    """Ask the runner loop of this process to hand its work back and return; ``within``: the
    seconds it has before the process is made to exit (``stop_deadline``)."""
    global _deadline
    if within is not None:
        _deadline = time.monotonic() + within
    _stop.set()


def stop_deadline() -> float | None:
    """When (``time.monotonic()``) the process will be made to exit after ``request_stop``,
    or ``None`` if the request named no time."""
    return _deadline if _stop.is_set() else None


def stop_requested() -> bool:
    """Whether ``request_stop`` was called (and ``reset`` not since)."""
    return _stop.is_set()


def reset() -> None:
    """Clear the request (tests, and a worker that decided to carry on)."""
    global _deadline
    _deadline = None
    _stop.clear()
