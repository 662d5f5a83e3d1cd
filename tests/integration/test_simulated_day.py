"""The default simulated day (``offpeak sim``): the real runner on a virtual clock over 24
hours of load and 40 batches keeps every batch inside its window and fills the valleys. Nothing
external, but hundreds of thousands of simulated engine steps: too long for the unit tier."""

from __future__ import annotations

from workers.sim.day import simulate_day


def test_default_day_keeps_every_window_and_fills_the_valleys() -> None:
    report = simulate_day()
    assert report.batches == 40 and report.inside_window_pct == 100.0
    assert report.valley_used_pct >= 90.0
    assert report.completion_tokens == report.offered_tokens  # every line ran, once
    # Batch work stops within one load poll (1 s) of each crossing of the high-water mark.
    assert report.busy_above_high_seconds < 5.0
    assert report.urgent_batches == 0 and report.expired == 0
    assert report.cached_tokens > 0  # each batch's lines share a system prompt
