"""The simulated real-time load: a diurnal day of load on the water-mark scale (0 idle,
1 saturated) and the load signal that reads it at the virtual time."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

#: Seconds between the knots of the load curve (hourly values and noise are interpolated).
KNOT_SECONDS = 300


def diurnal_curve(trough: float = 0.05, peak: float = 0.85, peak_hour: float = 14.0) -> list[float]:
    """24 hourly real-time loads on a cosine: ``peak`` at ``peak_hour``, ``trough`` 12 h later."""
    mid, amplitude = (peak + trough) / 2, (peak - trough) / 2
    return [mid + amplitude * math.cos(2 * math.pi * (h - peak_hour) / 24) for h in range(24)]


class LoadCurve:
    """A periodic day of real-time load: hourly values, linearly interpolated, plus smooth noise
    (a uniform draw in ``±noise`` every ``KNOT_SECONDS``, interpolated too), clipped at 0."""

    def __init__(self, hourly: Sequence[float], noise: float = 0.0, seed: int = 0) -> None:
        if len(hourly) != 24:
            raise ValueError("the load curve needs 24 hourly values")
        rng = random.Random(seed)
        knots_per_hour = 3600 // KNOT_SECONDS
        self.knots = []
        for k in range(24 * knots_per_hour):
            hour, frac = divmod(k / knots_per_hour, 1.0)
            a, b = hourly[int(hour)], hourly[(int(hour) + 1) % 24]
            jitter = rng.uniform(-noise, noise) if noise else 0.0
            self.knots.append(max(0.0, a + (b - a) * frac + jitter))

    def at(self, seconds: float) -> float:
        """The load ``seconds`` after midnight of the first day (the day repeats)."""
        position = (seconds % 86_400) / KNOT_SECONDS
        i = int(position)
        frac = position - i
        a, b = self.knots[i], self.knots[(i + 1) % len(self.knots)]
        return a + (b - a) * frac


class CurveSignal:
    """The load signal of the simulated real-time server: the curve at the virtual time."""

    name = "simulated"

    def __init__(self, curve: LoadCurve, start: float) -> None:
        self.curve, self.start = curve, start

    def read(self, at: float) -> float:
        return self.curve.at(at - self.start)
