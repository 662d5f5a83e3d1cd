"""A worker process's stop request, shared by its signal handlers and the runner's loop.

The engine worker's SIGTERM handler calls ``request_stop``; the runner checks ``stop_requested``
every turn of its loop and, once it is set, stops admitting, writes back what finished, hands the
lines it holds back to pending and returns (``DrainStats.outcome == "stopped"``), so the worker
can close its engine and exit. A ``threading.Event``: the heartbeat thread and a signal handler
may set or read it while the loop runs.
"""

from __future__ import annotations

import threading

_stop = threading.Event()


def request_stop() -> None:
    """Ask the runner loop of this process to hand its work back and return."""
    _stop.set()


def stop_requested() -> bool:
    """Whether ``request_stop`` was called (and ``reset`` not since)."""
    return _stop.is_set()


def reset() -> None:
    """Clear the request (tests, and a worker that decided to carry on)."""
    _stop.clear()
