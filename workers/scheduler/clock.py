"""Time for the scheduler: the wall clock in workers, a virtual clock in the simulation.

Everything in the runner that reads or waits for time goes through a ``Clock``, so the same
code runs a day of simulated load in seconds.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Unix seconds now (leases, deadlines and windows are compared with it)."""
        ...

    def monotonic(self) -> float:
        """Seconds for measuring durations (engine busy time); never goes back."""
        ...

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``."""
        ...


class WallClock:
    """Real time."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class VirtualClock:
    """Time that moves only when told: ``sleep`` and ``advance`` jump forward at once."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` (negative values are ignored)."""
        if seconds > 0:
            self.now += seconds
