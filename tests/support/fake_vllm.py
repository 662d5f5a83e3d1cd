"""A made-up vLLM server for the lane's tests: Prometheus histograms of a server whose decode step
costs ``base + per_seq × running`` seconds."""

from __future__ import annotations

import math

from workers.vllm_metrics import Histogram, ServerSnapshot

BOUNDS = (0.01, 0.02, 0.04, 0.08, math.inf)


def hist(*per_bucket: float) -> Histogram:
    """A cumulative histogram from per-bucket counts over ``BOUNDS``."""
    total, counts = 0.0, []
    for c in per_bucket:
        total += c
        counts.append(total)
    return Histogram(BOUNDS, tuple(counts))


class FakeServer:
    """Readings of a server whose step is ``base + per_seq × running``: each ``advance`` adds
    one interval's tokens at that latency and first tokens at twice it."""

    def __init__(self, base: float = 0.01, per_seq: float = 0.002) -> None:
        self.base, self.per_seq = base, per_seq
        self.tpot = [0.0] * len(BOUNDS)
        self.ttft = [0.0] * len(BOUNDS)
        self.sums = [0.0, 0.0]
        self.realtime = 2
        self.waiting = 0.0
        self.at = 0.0

    def advance(self, seconds: float, in_flight: int) -> ServerSnapshot:
        self.at += seconds
        running = self.realtime + in_flight
        step = self.base + self.per_seq * running
        for k, (values, latency, n) in enumerate(
            ((self.tpot, step, running * seconds / step), (self.ttft, 2 * step, self.realtime))
        ):
            i = next(i for i, b in enumerate(BOUNDS) if latency <= b)
            values[i] += n
            self.sums[k] += n * latency
        return self.snapshot(running)

    def snapshot(self, running: int) -> ServerSnapshot:
        def cum(v: list[float], total: float) -> Histogram:
            return Histogram(BOUNDS, tuple(sum(v[: i + 1]) for i in range(len(v))), total)

        tpot, ttft = cum(self.tpot, self.sums[0]), cum(self.ttft, self.sums[1])
        return ServerSnapshot(self.at, tpot, ttft, running, self.waiting)
