"""Simulations: the scheduler and the batching policies on a virtual clock, with fakes in place
of the engine, the database and the real-time server. Production code never imports this package
(the worker, the tasks, the scheduler, the API and storage); the CLI's ``offpeak simulate``, the
tests and the benchmarks do.

- ``day``: a simulated day (``offpeak simulate day``): the real ``workers.runner.Runner`` driven
  by the fakes below, and what it measures.
- ``engine``: ``SimEngine``, the ``Engine`` interface costing each step by the step model.
- ``store``: ``MemoryStore``, the ``WorkStore`` interface in memory, fed by batch arrivals.
- ``load``: the diurnal real-time load curve and the load signal that reads it.
- ``policies``: one at a time vs static vs continuous batching (``offpeak simulate policies``),
  the table of ``docs/planning.md``.
"""
