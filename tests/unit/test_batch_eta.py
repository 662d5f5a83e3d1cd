"""The batch ETA from given queues and rates (``api.services.batch_eta``): lines ahead in claim
order, the measured rate, the estimate and the warning past the window. Nothing external."""

from __future__ import annotations

import pytest

from api.services.batch_eta import (
    WARNING_CODE,
    completion_at,
    lines_ahead,
    lines_per_second,
    warning,
)
from storage.repositories.scheduler import EngineHistory
from storage.repositories.tenant_views import QueuedBatch

T0 = 1_800_000_000


def queued(
    batch_id: str, tenant: str, left: int, *, weight: float = 1.0, model: str = "m", due: int = 0
) -> QueuedBatch:
    return QueuedBatch(batch_id, tenant, weight, model, left, T0 + 86_400 + due, 86_400, None)


def test_a_lone_batch_has_nothing_ahead() -> None:
    mine = queued("b", "t", 40)
    assert lines_ahead(mine, [mine], set()) == 0


def test_other_tenants_are_served_in_proportion_to_their_weights() -> None:
    mine = queued("b", "t", 10)
    small, big = queued("s", "u", 4), queued("g", "v", 1000, weight=2.0)
    # While t runs its 10 lines, u runs all 4 of its, v (weight 2) runs 20 of its 1000.
    assert lines_ahead(mine, [mine, small, big], set()) == 4 + 20


def test_a_tenants_own_batches_share_its_lines_evenly() -> None:
    mine, other_own = queued("b", "t", 10), queued("c", "t", 50)
    theirs = queued("x", "u", 100)
    # t's other batch runs 10 beside b: t runs 20 lines, so u runs 20 meanwhile.
    assert lines_ahead(mine, [mine, other_own, theirs], set()) == 10 + 20


def test_urgent_lines_go_first_and_urgent_batches_by_deadline() -> None:
    mine = queued("b", "t", 10, due=100)
    early, late = queued("e", "u", 30, due=0), queued("l", "v", 7, due=500)
    assert lines_ahead(mine, [mine, early, late], {"e", "l"}) == 30 + 7
    # Urgent itself: only the urgent lines due no later are ahead.
    assert lines_ahead(mine, [mine, early, late], {"b", "e", "l"}) == 30


def test_other_models_and_finished_batches_are_not_ahead() -> None:
    mine = queued("b", "t", 10)
    other_model, done = queued("o", "u", 500, model="other"), queued("d", "u", 0)
    assert lines_ahead(mine, [mine, other_model, done], set()) == 0
    assert lines_ahead(queued("z", "t", 0), [mine], set()) == 0


def test_the_rate_is_measured_lines_per_busy_second_times_live_engines() -> None:
    assert lines_per_second(EngineHistory(50, 900, 10.0, "cpu"), 0) == pytest.approx(5.0)
    assert lines_per_second(EngineHistory(50, 900, 10.0, "cpu"), 3) == pytest.approx(15.0)
    # Too few lines, or no busy time: nothing measured.
    assert lines_per_second(EngineHistory(4, 90, 10.0, "cpu"), 1) is None
    assert lines_per_second(EngineHistory(50, 900, 0.0, "cpu"), 1) is None


def test_the_estimate_is_now_plus_the_lines_through_the_batch_over_the_rate() -> None:
    assert completion_at(T0, 30, 10, 2.0) == T0 + 20
    assert completion_at(T0, 0, 10, 0.5) == T0 + 20
    # Nothing left: now; no rate: unknown.
    assert completion_at(T0, 30, 0, None) == T0
    assert completion_at(T0, 30, 10, None) is None
    assert completion_at(T0, 30, 10, 0.0) is None


def test_the_warning_only_past_the_window() -> None:
    expires = T0 + 86_400
    assert warning(expires, None) is None
    assert warning(expires, float(expires)) is None
    late = warning(expires, expires + 3 * 3600.0)
    assert late is not None and late["code"] == WARNING_CODE
    assert late["estimated_completion_at"] == expires + 3 * 3600
    assert late["expires_at"] == expires and "3.0 h" in late["message"]
