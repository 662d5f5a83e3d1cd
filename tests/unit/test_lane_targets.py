"""Latency targets as users state them: absolute p95s or ratios to the alone baseline, for the
pool (environment), per model (``ModelConfig.lane``) and as the co-serving bench's flags."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from bench.slo import Slo, bench_lane
from offpeak.lane_settings import LaneSettings, LaneTargets
from offpeak.settings import ModelConfig, SchedulerSettings, Settings
from workers.lane.controller import LaneController
from workers.lane.steering import LaneSteering
from workers.planner import StepModel


def test_environment_sets_the_pool_lane_and_a_models_own_targets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OFFPEAK_SCHEDULER__LANE__TPOT_RATIO", "1.5")
    monkeypatch.setenv("OFFPEAK_SCHEDULER__LANE__TTFT_P95_MS", "800")
    model = {"engine": "remote", "url": "http://rt:8000", "lane": {"ttft_ratio": 1.8}}
    monkeypatch.setenv("OFFPEAK_MODELS", json.dumps({"m": model}))
    settings = Settings()
    pool = settings.scheduler.lane
    assert (pool.tpot_ratio, pool.ttft_p95_ms) == (1.5, 800.0)
    steering = LaneSteering.for_model(
        settings.scheduler, settings.models["m"], 8, StepModel(), server=object(), model="m"
    )  # type: ignore[arg-type]
    assert steering is not None
    lane = steering.controller.settings
    # The model's ratio wins over the pool's absolute TTFT target; TPOT stays the pool's.
    assert (lane.ttft_ratio, lane.ttft_p95_ms, lane.tpot_ratio) == (1.8, None, 1.5)


def test_a_models_absolute_target_overrides_the_pools_ratio() -> None:
    lane = LaneSettings(tpot_ratio=3.0).with_targets(
        LaneTargets(tpot_p95_ms=60.0, baseline_ttft_ms=200.0)
    )
    controller = LaneController(lane, max_num_seqs=8, step_model=StepModel(10.0, 1.0))
    assert controller.tpot_target() == pytest.approx(0.060)
    assert controller.ttft_target() == pytest.approx(2.4 * 0.200)
    assert LaneSettings().with_targets(None) == LaneSettings()


def test_bench_flags_go_over_environment_and_model() -> None:
    env = LaneSettings(tpot_p95_ms=50.0, ttft_ratio=3.0)
    model = LaneTargets(ttft_p95_ms=900.0)
    lane = bench_lane(env, model, tpot_ratio=1.5, ttft_ratio=1.5)
    assert (lane.tpot_ratio, lane.tpot_p95_ms, lane.ttft_ratio, lane.ttft_p95_ms) == (
        1.5, None, 1.5, None,
    )  # fmt: skip
    assert bench_lane(env, model).ttft_p95_ms == 900.0
    assert bench_lane(env, ttft_ms=400.0).ttft_p95_ms == 400.0
    with pytest.raises(ValidationError):
        bench_lane(env, tpot_ratio=0.9)


def test_slo_targets_are_absolute_or_a_ratio_of_the_alone_p95() -> None:
    slo = Slo.of(bench_lane(LaneSettings(), tpot_ratio=1.5, ttft_ms=800.0))
    assert slo.target("tpot", 0.100) == pytest.approx(0.150)
    assert slo.target("ttft", 0.300) == pytest.approx(0.800)
    assert slo.target("ttft", None) == pytest.approx(0.800)
    assert slo.target("tpot", None) is None
    assert slo.describe() == "TTFT p95 ≤ 800 ms, TPOT p95 ≤ 1.5 × alone"


def test_scheduler_settings_keep_the_lane_a_nested_model() -> None:
    policy = SchedulerSettings.model_validate({"lane": {"ttft_p95_ms": 700}})
    assert policy.lane.ttft_p95_ms == 700.0
    assert ModelConfig(engine="remote", url="http://a").lane is None
