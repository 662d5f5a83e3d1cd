"""How many engine replicas the backlog needs: the tightest deadline first, capped by what engines
can share."""

from __future__ import annotations

import pytest

from offpeak.settings import SchedulerSettings
from storage.repositories.scheduler import BatchBacklog
from workers.scheduler.slack import replicas_needed

#: No margin: a batch must finish by its deadline.
NO_MARGIN = SchedulerSettings(urgent_margin_fraction=0.0, urgent_margin_seconds=0.0)


def backlog(*batches: tuple[str, float, int]) -> list[BatchBacklog]:
    """``(batch_id, expires_at, lines left)``, none finished yet."""
    return [BatchBacklog(b, expires, 86_400, lines, 0, 0, 0) for b, expires, lines in batches]


def test_replicas_cover_the_tightest_deadline_in_deadline_order() -> None:
    # 100 tokens/s per engine, 10 tokens a line. "a": 1,000 tokens in 20 s: half an engine;
    # "b" comes after "a": 10,000 tokens in 50 s, 2 engines. The tightest is the answer.
    work = backlog(("b", 1050.0, 900), ("a", 1020.0, 100))
    assert replicas_needed(work, 1000.0, 100.0, 10.0, NO_MARGIN, slots=256) == 2
    # A new engine starting for 10 s: "a" has 10 s (1 engine), "b" 40 s (2.5: 3 engines).
    assert replicas_needed(work, 1000.0, 100.0, 10.0, NO_MARGIN, 256, startup_seconds=10) == 3
    # Twice the throughput, half the engines (rounded up).
    assert replicas_needed(work, 1000.0, 200.0, 10.0, NO_MARGIN, slots=256) == 1
    # A margin of 25 s (urgent_margin_seconds) leaves "b" 25 s: 10,000 / (100 x 25) = 4.
    margin = SchedulerSettings(urgent_margin_fraction=0.0, urgent_margin_seconds=25.0)
    assert replicas_needed(backlog(("b", 1050.0, 1000)), 1000.0, 100.0, 10.0, margin, 256) == 4


def test_replicas_are_capped_by_what_engines_can_share_and_zero_without_work() -> None:
    # 1,000 lines with 1 s left would want 100 engines; 64 sequences per engine: 16 can share it.
    late = backlog(("late", 1001.0, 1000))
    assert replicas_needed(late, 1000.0, 100.0, 10.0, NO_MARGIN, slots=64) == 16
    # Past its deadline: as many engines as can share the work, not infinity.
    overdue = backlog(("overdue", 900.0, 100))
    assert replicas_needed(overdue, 1000.0, 100.0, 10.0, NO_MARGIN, slots=64) == 2
    assert replicas_needed([], 1000.0, 100.0, 10.0, NO_MARGIN, slots=64) == 0
    assert replicas_needed(backlog(("done", 2000.0, 0)), 1000.0, 100.0, 10.0, NO_MARGIN, 64) == 0
    # Any work at all needs an engine, however far its deadline.
    assert replicas_needed(backlog(("far", 1e9, 1)), 1000.0, 100.0, 10.0, NO_MARGIN, 64) == 1
    with pytest.raises(ValueError):
        replicas_needed(late, 1000.0, 0.0, 10.0, NO_MARGIN, slots=64)
