"""The load gate: the pool's load signals (``workers.scheduler.signals``), read every
``load_poll_seconds`` into the hysteresis gate (``workers.scheduler.gate``) and published
for the dashboard and the other workers."""

from __future__ import annotations

import logging
import math
from typing import Any

from offpeak.settings import SchedulerSettings
from storage.errors import TRANSIENT_DB_ERRORS
from workers.scheduler import scheduler_metrics as metrics
from workers.scheduler.clock import Clock, WallClock
from workers.scheduler.gate import Gate
from workers.scheduler.signals import BackgroundMonitor, LoadMonitor, build_signals
from workers.scheduler.store import WorkStore

log = logging.getLogger(__name__)


class LoadGate:
    """The gate and the monitor that feeds it. ``monitor`` defaults to the pool's configured
    signals, read on a thread of their own on the wall clock so that a slow metrics endpoint
    cannot stall the engine's steps."""

    def __init__(
        self,
        policy: SchedulerSettings,
        store: WorkStore,
        owner: str,
        clock: Clock,
        monitor: LoadMonitor | None = None,
        *,
        export_metrics: bool = True,
    ) -> None:
        self.policy, self.store, self.owner = policy, store, owner
        self.export_metrics = export_metrics
        self.monitor: LoadMonitor | BackgroundMonitor = monitor or LoadMonitor(
            build_signals(policy), pause=lambda: store.pause_state(policy.pool)
        )
        if monitor is None and isinstance(clock, WallClock):
            self.monitor = BackgroundMonitor(
                self.monitor,
                policy.load_poll_seconds,
                stale_after=3 * policy.load_poll_seconds + policy.prometheus.timeout_seconds,
            )
        self.gate = Gate(policy.low_water, policy.high_water, policy.on_signal_error)
        #: Clock time of the next reading.
        self.next_at = -math.inf
        self._published_at = -math.inf

    def restart(self) -> None:
        """Act on a fresh reading next (a new drain), not on the one that ended the last."""
        self.next_at = -math.inf
        if isinstance(self.monitor, BackgroundMonitor):
            self.monitor.refresh()

    def observe(self, at: float) -> bool:
        """Read the load into the gate when a reading is due at clock time ``at``, publishing it
        when the gate changed or every ``estimate_seconds``. Returns whether the gate just
        closed or hard-paused (the runner then yields)."""
        if at < self.next_at:
            return False
        self.next_at = at + self.policy.load_poll_seconds
        gate = self.gate
        was_open, was_hard = gate.open, gate.hard_paused
        reading = self.monitor.read(at)
        gate.update(reading)
        if self.export_metrics:
            metrics.observe_gate(self.policy.pool, reading, gate)
        changed = was_open != gate.open or was_hard != gate.hard_paused
        if changed or at - self._published_at >= self.policy.estimate_seconds:
            self._publish(reading.as_json() | {"gate_open": gate.open}, at)
        return (was_open and not gate.open) or (gate.hard_paused and not was_hard)

    def _publish(self, reading: dict[str, Any], at: float) -> None:
        try:
            self.store.publish_load(self.policy.pool, reading | {"worker": self.owner}, at)
            self._published_at = at
        except TRANSIENT_DB_ERRORS as exc:
            log.warning("cannot publish the load reading: %s", exc)
