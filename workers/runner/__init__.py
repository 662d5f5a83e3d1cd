"""The runner: the scheduler's loop around one model's engine, in parts.

- ``loop``: ``Runner``, the loop that ties the parts: engine steps, yields, write-backs,
  stops (start reading here);
- ``load_gate``: the load signals read into the hysteresis gate;
- ``urgency``: the batches' slack estimates and the urgent set;
- ``claims``: the claim pipeline (how much to claim, claims on the claim thread through
  ``claim_ahead``, the chunk queued and the engine's slots sized);
- ``hand_back``: every held line back to pending after a fault or on a stop;
- ``stats``: a run's totals and the engine's recent tokens/s;
- ``held``: the lines held in memory, queued or running, and how they join the engine (the
  suspect rule that isolates a poison line);
- ``admission``: a claimed chunk prepared for the engine (the attempts cap, preparation, the
  order of a chunk);
- ``write_back``: finished lines and engine seconds written back, lines handed back;
- ``results``: a line's end as it is stored (``storage.repositories.requests.FinishedLine``);
- ``gc_tuning``: the engine worker's garbage-collector threshold (a line's objects outlive
  CPython's default young generation).

With a shared real-time server the loop also follows the batch lane's limit (``workers.lane``).
"""

from offpeak.ids import worker_id
from workers.runner.loop import Runner
from workers.runner.stats import DrainStats

__all__ = ["DrainStats", "Runner", "worker_id"]
