"""A released engine's reload counts in the slack of the urgency estimate."""

from __future__ import annotations

import pytest

from offpeak.settings import Settings
from storage.repositories.scheduler import BatchBacklog
from workers.scheduler.slack import estimate


def test_reload_seconds_count_in_the_slack() -> None:
    """100 lines x 10 tokens at 100 tokens/s: done in 10 s, 50 s before the deadline. A reload
    of 45 s leaves 5 s, under a 20 s margin: the batch is urgent with it, not without."""
    policy = Settings().scheduler.model_copy(
        update={"urgent_margin_fraction": 0.0, "urgent_margin_seconds": 20.0}
    )
    backlog = [BatchBacklog("b", 1060.0, 60, 100, 0, 0, 0)]
    (loaded,) = estimate(backlog, 1000.0, 100.0, 10.0, policy)
    (released,) = estimate(backlog, 1000.0, 100.0, 10.0, policy, startup_seconds=45.0)
    assert loaded.slack_seconds == pytest.approx(50.0) and not loaded.urgent
    assert released.slack_seconds == pytest.approx(5.0) and released.urgent
    assert released.estimated_completion_at - loaded.estimated_completion_at == 45.0
