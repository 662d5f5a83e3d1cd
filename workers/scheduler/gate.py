"""The gate: whether batch work may start, from load readings, with hysteresis.

Batch work stops when the load reaches the high-water mark and starts again only once it has
fallen to the low-water mark; in between, the gate keeps its last state. Without the gap a load
hovering around one threshold would start and stop batch work every reading, and every stop
costs the work in flight.
"""

from __future__ import annotations

import logging
from typing import Literal

from workers.scheduler.signals import LoadReading

log = logging.getLogger(__name__)


class Gate:
    """Open: new batch work may start. Closed: only urgent batches run (none on a hard pause).

    ``on_error="busy"`` closes the gate while any signal is unreadable; ``"ignore"`` decides on
    the signals that could be read.
    """

    def __init__(
        self, low_water: float, high_water: float, on_error: Literal["busy", "ignore"] = "busy"
    ) -> None:
        if not 0 <= low_water <= high_water:
            raise ValueError("need 0 <= low_water <= high_water")
        self.low_water = low_water
        self.high_water = high_water
        self.on_error = on_error
        #: The hysteresis state of the load alone; ``None`` before the first reading.
        self._load_open: bool | None = None
        self.open = True
        #: Why the gate is as it is, for logs and the admin view.
        self.reason = "no reading yet"
        #: Times the gate opened or closed.
        self.changes = 0
        self.last: LoadReading | None = None
        #: ``at`` of the reading that closed the gate (unix seconds); ``None`` while it is open.
        self.closed_since: float | None = None

    @property
    def hard_paused(self) -> bool:
        """A hard admin pause: not even urgent batches may run."""
        return self.last is not None and self.last.pause.hard

    def update(self, reading: LoadReading) -> bool:
        """Take a reading; returns whether the gate is now open."""
        self.last = reading
        load = reading.load
        if self._load_open is None:
            self._load_open = load < self.high_water
        elif self._load_open and load >= self.high_water:
            self._load_open = False
        elif not self._load_open and load <= self.low_water:
            self._load_open = True
        if reading.pause.paused:
            is_open = False
            self.reason = "paused by admin" + (
                f": {reading.pause.reason}" if reading.pause.reason else ""
            )
        elif reading.errors and self.on_error == "busy":
            is_open = False
            self.reason = "unreadable signal counts as busy: " + "; ".join(
                f"{k}: {v}" for k, v in reading.errors.items()
            )
        elif not self._load_open:
            is_open = False
            self.reason = (
                f"load {load:.2f} above low-water {self.low_water:g} since it reached "
                f"high-water {self.high_water:g}"
            )
        else:
            is_open = True
            self.reason = f"load {load:.2f} below high-water {self.high_water:g}"
        if is_open != self.open:
            self.changes += 1
            log.info("batch work %s: %s", "resumes" if is_open else "yields", self.reason)
        self.open = is_open
        if is_open:
            self.closed_since = None
        elif self.closed_since is None:
            self.closed_since = reading.at
        return is_open

    def closed_for(self, at: float) -> float:
        """Seconds the gate has been closed at ``at`` (unix seconds); 0 while it is open."""
        return 0.0 if self.closed_since is None else max(0.0, at - self.closed_since)
