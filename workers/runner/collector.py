"""The engine worker's cyclic garbage collector: collect the young generation less often.

CPython collects its youngest generation once tracked objects allocated exceed those freed by
700 (``gc.get_threshold()[0]``), and every object that survives two such collections is
promoted to the oldest generation, which is then collected whole, the process's entire heap
traversed (SQLAlchemy, pydantic, Celery, the engine's own objects). A runner holds each line
it claimed for a claim-to-write-back cycle (a claimed chunk, prepared; then its answer and
record until the write-back): ~15 tracked objects a line, a few hundred lines at a time, far
more than 700 and alive long enough to survive two collections, so nearly every line's objects
reached the oldest generation and triggered its full collections. ``offpeak bench control``'s
runner drained in process (20,000 lines, the instant engine; 2 December, load 0.5-1.0): 320
young, 29 middle and 3 full collections, 35-54 µs of the worker's CPU a line (of 129-205),
0.5-0.75 s of it in the full ones, ~200 ms each. At ``YOUNG_THRESHOLD`` most lines' objects
are freed by their reference counts before a collection comes: 3-4 young collections, one
middle, no full one, 1.8-3.0 µs a line.

Nothing but when garbage cycles are found changes: every collection still runs, cycles wait
for at most ``YOUNG_THRESHOLD`` net allocations (a few MB), and code that must free memory at
a point (a vLLM engine's ``close``) calls ``gc.collect()`` itself.
"""

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
