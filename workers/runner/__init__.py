"""The runner: the scheduler's loop around one model's engine, in parts.

- ``loop``: ``Runner``, the loop itself: load and deadlines, claims, engine steps, yields,
  faults and stops (start reading here);
- ``held``: the lines held in memory, queued or running, and how they join the engine (the
  suspect rule that isolates a poison line);
- ``admission``: a claimed chunk prepared for the engine (the attempts cap, preparation, the
  order of a chunk);
- ``writeback``: finished lines and engine seconds written back, lines handed back;
- ``results``: a line's end as it is stored (``storage.repositories.requests.FinishedLine``);
- ``collector``: the engine worker's garbage-collector threshold (a line's objects outlive
  CPython's default young generation).
"""

from offpeak.ids import worker_id
from workers.runner.loop import DrainStats, Runner

__all__ = ["DrainStats", "Runner", "worker_id"]
