"""The simulated day: the real runner on a virtual clock with the default step model. Constant high
load runs only what is urgent; hysteresis keeps a noisy load from flapping the gate; the CLI
prints the figures. (The default whole day: ``tests/integration/test_simulated_day.py``.)"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from offpeak.cli import app
from offpeak.settings import SchedulerSettings
from workers.sim.day import DayParams, simulate_day
from workers.sim.load import LoadCurve, diurnal_curve
from workers.sim.store import Arrival


def test_under_constant_high_load_only_urgent_batches_run_and_still_make_it() -> None:
    lines = [([1, 2, 3, 4] * 8, 1000)] * 300  # 300k tokens: ~2.2 min at 256 sequences
    params = DayParams(hours=3, load_curve=(0.9,) * 24, noise=0.0, window="1h")
    arrivals = [Arrival(0, lines), Arrival(600, lines), Arrival(1200, lines)]
    report = simulate_day(params, arrivals=arrivals)
    assert report.inside_window_pct == 100.0
    assert report.urgent_batches == 3  # nothing else could run
    assert report.valley_seconds == 0 and report.busy_above_high_seconds > 0
    # Each waited until its slack reached the margin (6 min of its hour) instead of running
    # at once: all three ended in their last quarter hour.
    assert report.last_end_hours > 1200 / 3600 + 0.75


def test_hysteresis_keeps_a_noisy_load_from_flapping_the_gate() -> None:
    # A load hovering around 0.45 with noise: without a gap between the marks the gate flips
    # whenever the noise crosses 0.45.
    flat = tuple([0.45] * 24)
    params = DayParams(hours=2, load_curve=flat, noise=0.1)
    lines = [([7] * 16, 2000)] * 2500  # 5M tokens: more than the 2 h can serve while open
    arrivals = [Arrival(0, lines)]
    no_gap = simulate_day(params, SchedulerSettings(low_water=0.45, high_water=0.45), arrivals)
    gap = simulate_day(params, SchedulerSettings(low_water=0.3, high_water=0.6), arrivals)
    assert no_gap.gate_changes >= 10 and gap.gate_changes <= 1
    # Every flip aborted running work, which then ran again: the same work took longer.
    assert no_gap.aborted > 0 and gap.aborted == 0
    assert gap.last_end_hours < no_gap.last_end_hours


def test_load_curve_interpolates_and_repeats() -> None:
    curve = LoadCurve(diurnal_curve(trough=0.1, peak=0.9, peak_hour=14), noise=0.0)
    assert curve.at(14 * 3600) == pytest.approx(0.9)
    assert curve.at(2 * 3600) == pytest.approx(0.1)  # 12 h from the peak
    assert curve.at(14.5 * 3600) == pytest.approx((curve.at(14 * 3600) + curve.at(15 * 3600)) / 2)
    assert curve.at(14 * 3600 + 86_400) == curve.at(14 * 3600)


def test_simulate_day_command_prints_the_figures() -> None:
    args = ["simulate", "day", "--hours", "6", "--batches", "4", "--fill", "0.5"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["batches"] == 4 and summary["inside_window_pct"] == 100.0
    table = CliRunner().invoke(app, args)
    for phrase in (
        "inside their window",
        "batch tokens served",
        "valley idle capacity used",
        "batch work while load > high-water",
    ):
        assert phrase in table.output
