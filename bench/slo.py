"""The co-serving benchmark's service-level objective, as a team states it: each of TTFT p95 and
TPOT p95 either an absolute number of milliseconds or a ratio to what real-time users get with no
batch work (leg (a) of ``bench colocate``).

One statement drives both sides: the lane of leg (c) gets it as its ``LaneSettings`` (from the
environment, ``OFFPEAK_SCHEDULER__LANE__…``, then the model's ``lane`` targets, then the bench's
flags), and the verdict holds leg (c) to it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from offpeak.lane_settings import LaneSettings, LaneTargets


@dataclass(frozen=True)
class Slo:
    """Targets on real-time p95s: ``…_ms`` absolute (milliseconds), else ``…_ratio ×`` the p95
    measured with no batch work."""

    tpot_ratio: float
    ttft_ratio: float
    tpot_ms: float | None = None
    ttft_ms: float | None = None

    @classmethod
    def of(cls, lane: LaneSettings) -> Slo:
        return cls(lane.tpot_ratio, lane.ttft_ratio, lane.tpot_p95_ms, lane.ttft_p95_ms)

    def target(self, kind: str, alone_p95: float | None) -> float | None:
        """Seconds: the ``kind`` (``tpot`` | ``ttft``) target, given the p95 with no batch work
        (seconds; ``None`` when not measured: then only an absolute target exists)."""
        absolute = getattr(self, f"{kind}_ms")
        if absolute is not None:
            return absolute / 1000
        return None if alone_p95 is None else getattr(self, f"{kind}_ratio") * alone_p95

    def describe(self) -> str:
        def one(kind: str) -> str:
            absolute = getattr(self, f"{kind}_ms")
            if absolute is not None:
                return f"{kind.upper()} p95 ≤ {absolute:g} ms"
            return f"{kind.upper()} p95 ≤ {getattr(self, f'{kind}_ratio'):g} × alone"

        return f"{one('ttft')}, {one('tpot')}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def bench_lane(
    lane: LaneSettings,
    model_targets: LaneTargets | None = None,
    *,
    tpot_ratio: float | None = None,
    ttft_ratio: float | None = None,
    tpot_ms: float | None = None,
    ttft_ms: float | None = None,
) -> LaneSettings:
    """The lane settings of the bench's leg (c): ``lane`` (the environment's), the model's own
    targets over it, the bench's flags over both. Raises ``pydantic.ValidationError`` for a
    ratio ≤ 1 or a non-positive number of milliseconds."""
    flags = LaneTargets(
        tpot_ratio=tpot_ratio, ttft_ratio=ttft_ratio, tpot_p95_ms=tpot_ms, ttft_p95_ms=ttft_ms
    )
    return lane.with_targets(model_targets).with_targets(flags)
