"""Queue positions under the fair-share rule and engine shares, from rows made up here."""

from __future__ import annotations

import pytest

from api.services.tenant_views import is_urgent, positions, shares
from offpeak.settings import SchedulerSettings
from storage.repositories.tenant_views import QueuedBatch, Served


def _batch(batch_id: str, tenant: str, left: int, weight: float = 1.0, model: str = "m",
           expires_at: int = 100_000, estimated: float | None = None) -> QueuedBatch:  # fmt: skip
    return QueuedBatch(batch_id, tenant, weight, model, left, expires_at, 86_400, estimated)


def test_a_small_tenant_waits_for_its_share_of_a_big_one_not_for_all_of_it() -> None:
    queue = positions([_batch("b1", "big", 50_000), _batch("s1", "small", 5)], urgent=set())
    assert queue["small"][0].lines_ahead == 5  # one of big's lines per line of its own
    assert queue["big"][0].lines_ahead == 5  # all of small's: it is done first


def test_weights_scale_what_others_are_served_meanwhile() -> None:
    batches = [_batch("a", "light", 100), _batch("b", "heavy", 100, weight=3.0)]
    queue = positions(batches, urgent=set())
    assert queue["light"][0].shared_lines_ahead == 100  # capped at what heavy has queued
    assert queue["heavy"][0].shared_lines_ahead == 34  # 100 × 1/3, rounded up


def test_urgent_lines_come_first_and_models_are_apart() -> None:
    batches = [
        _batch("u", "late", 7, expires_at=50),
        _batch("x", "other", 3),
        _batch("y", "other", 9, model="n"),
    ]
    queue = positions(batches, urgent={"u"})
    assert queue["other"][0].urgent_lines_ahead == 7 and queue["other"][0].model == "m"
    assert queue["other"][1].lines_ahead == 0  # alone on model n
    assert queue["late"][0].lines_ahead == 0 and queue["late"][0].queued_lines == 7


def test_the_deadline_guards_rule_decides_urgency() -> None:
    rule = SchedulerSettings()
    margin = 0.1 * 86_400
    assert is_urgent(_batch("a", "t", 1, expires_at=100_000, estimated=100_000 - margin + 1), rule)
    assert not is_urgent(_batch("a", "t", 1, expires_at=100_000, estimated=0.0), rule)
    assert not is_urgent(_batch("a", "t", 1), rule)  # not estimated yet


def test_shares_against_the_weights_of_the_tenants_competing() -> None:
    served = [Served("a", 30, 3.0), Served("b", 10, 1.0)]
    out = shares(served, {"a": 1.0, "b": 1.0, "c": 2.0}, 3600)
    assert out["a"]["engine_share"] == pytest.approx(0.75)
    assert out["c"]["engine_share"] == 0.0 and out["c"]["entitled_share"] == pytest.approx(0.5)
    assert shares([], {"a": 1.0}, 3600)["a"]["engine_share"] is None


def test_the_urgency_margin_is_a_fraction_of_the_batchs_own_window() -> None:
    rule = SchedulerSettings()  # 10% of the window
    hour = QueuedBatch("h", "t", 1.0, "m", 1, 100_000, 3600, 100_000 - 400.0)
    day = QueuedBatch("d", "t", 1.0, "m", 1, 100_000, 86_400, 100_000 - 400.0)
    assert not is_urgent(hour, rule)  # 400 s of slack > 360 s
    assert is_urgent(day, rule)  # 400 s of slack < 8,640 s
