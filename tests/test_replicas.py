"""The autoscaling hint (issue 11, part 4): ``offpeak_replicas_needed{model}``, the engines that
finish every running batch before its deadline (minus its margin) at one engine's throughput:
the arithmetic (``workers.scheduler.slack.replicas_needed``), and the series on the API's
``/metrics`` after the control worker's sweep stored it."""

from __future__ import annotations

import logging
import math
import time

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from api.app import create_app
from offpeak.settings import CPU_MAX_NUM_SEQS, ModelConfig, SchedulerSettings, Settings
from storage.db import session_scope
from storage.models import Batch
from storage.repositories.scheduler import BatchBacklog
from tests import test_scheduler as scheduler_tests
from tests.test_scheduler import chat, make_batch, with_policy
from workers.scheduler.slack import replicas_needed, sweep_estimates

model = scheduler_tests.model
settings = scheduler_tests.settings
endpoint = scheduler_tests.endpoint
tenant = scheduler_tests.tenant

#: No margin: a batch must finish by its deadline.
NO_MARGIN = SchedulerSettings(urgent_margin_fraction=0.0, urgent_margin_seconds=0.0)


def backlog(*batches: tuple[str, float, int]) -> list[BatchBacklog]:
    """``(batch_id, expires_at, lines left)``, none finished yet."""
    return [BatchBacklog(b, expires, "24h", lines, 0, 0, 0) for b, expires, lines in batches]


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


def replicas_on_metrics(settings: Settings) -> dict[str, float]:
    token = {"Authorization": "Bearer replicas-metrics-token"}
    with TestClient(
        create_app(settings.model_copy(update={"metrics_token": "replicas-metrics-token"}))
    ) as client:
        text = client.get("/metrics", headers=token).text
    return {
        sample.labels["model"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "offpeak_replicas_needed"
        for sample in family.samples
    }


def test_replicas_needed_on_the_api_metrics_after_a_sweep(
    settings: Settings, model: str, tenant: tuple[str, OpenAI]
) -> None:
    """200 lines of 2,000 expected tokens due in 60 s (margin 10%: 6 s) on engines of 16 slots
    at the seed's step model (10 ms + 0.4 ms per sequence: 16 / 16.4 ms = 976 tokens/s): 400,000
    tokens in ~53 s need 8 engines. An idle configured model needs 0."""
    idle = f"{model}-idle"
    settings = with_policy(
        settings, expected_completion_tokens=2000, replica_startup_seconds=0.0
    ).model_copy(
        update={
            "models": {**settings.models, idle: ModelConfig(engine="instant")},
            "metrics_cache_seconds": 0.0,
        }
    )
    name, _sdk = tenant
    batch_id = make_batch(
        settings, name, [chat(model, f"r{i}", "Hi", 10) for i in range(200)], "60s"
    )
    with session_scope(settings.resolved_database_url) as session:
        expires_at = session.scalar(select(Batch.expires_at).where(Batch.id == batch_id))
    at = time.time()
    sweep_estimates(settings, [model, idle], at)
    tokens_per_second = 16 / (0.010 + 0.0004 * 16)
    expected = math.ceil(200 * 2000 / (tokens_per_second * (expires_at - 6.0 - at)))
    assert expected == 8, "the test's timing moved the expected value"
    found = replicas_on_metrics(settings)
    assert found[model] == expected
    assert found[idle] == 0.0


def test_a_model_left_at_the_default_sequence_limit_is_swept_at_its_devices_default(
    settings: Settings, model: str, tenant: tuple[str, OpenAI], caplog: pytest.LogCaptureFixture
) -> None:
    """``max_num_seqs`` unset (the default) is the device's default, 128 on a CPU (no engine
    chunk yet: the device is taken to be ``cpu``); the sweep failed on every such model
    (``max(1, None)``) and published nothing. 200 lines of 2,000 tokens due in 60 s would want
    4 engines of 128 sequences (2,092 tokens/s each at the seed's step model); 2 can share
    them."""
    assert ModelConfig(engine="instant").max_num_seqs is None
    settings = with_policy(
        settings, expected_completion_tokens=2000, replica_startup_seconds=0.0
    ).model_copy(
        update={"models": {model: ModelConfig(engine="instant")}, "metrics_cache_seconds": 0.0}
    )
    name, _sdk = tenant
    make_batch(settings, name, [chat(model, f"r{i}", "Hi", 10) for i in range(200)], "60s")
    with caplog.at_level(logging.ERROR, logger="workers.scheduler.slack"):
        sweep_estimates(settings, [model], time.time())
    assert caplog.records == []
    assert replicas_on_metrics(settings)[model] == math.ceil(200 / CPU_MAX_NUM_SEQS) == 2
