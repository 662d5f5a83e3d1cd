"""Collect the engine worker's young generation less often: a claimed line's objects are then
freed by reference counting before they are promoted and trigger full collections of the whole
heap (``offpeak bench control``)."""

from __future__ import annotations

import gc

#: Net allocations of tracked objects between young collections (CPython's default: 700).
YOUNG_THRESHOLD = 10_000


def tune_collector() -> None:
    """Raise the young generation's threshold to ``YOUNG_THRESHOLD`` for this process; the
    older generations' thresholds stay as they were. Process-wide: the engine worker calls it
    at start (``offpeak worker --role engine``), not the runner (tests and the simulator run
    runners in processes of their own)."""
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(max(_young, YOUNG_THRESHOLD), middle, old)
