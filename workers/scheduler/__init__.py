"""The scheduler: batch work in the valleys of real-time load, every batch inside its window.

- ``signals``: how busy the GPU is with real-time serving (Prometheus, NVML, an off-peak
  schedule, the admin pause switch, or always idle), one number per reading.
- ``gate``: whether batch work may start, with low- and high-water marks so it does not flap.
- ``slack``: each batch's estimated completion time and slack; urgent batches run regardless.
- ``chunking``: claim sizing from the engine's room and prefix-grouped ordering of a chunk.
- ``scheduler_metrics``: the scheduler's Prometheus gauges and counters (load, gate, slack, slots).
- ``store``: where request lines come from and results go (PostgreSQL; an in-memory store in
  the simulation); ``clock``: real or virtual time.
- ``lease_heartbeat``: renews the leases of a worker's lines during a long engine step (the
  worker's own is-alive heartbeat is ``workers.liveness``).

The loop that ties them together is ``workers.runner.Runner``; the policy is described for
operators in ``docs/scheduling.md``. The simulated day (``offpeak simulate day``, in the ``sim``
package beside this one) drives the same ``Runner`` with a fake engine and store on a virtual
clock; nothing here imports it.
"""
