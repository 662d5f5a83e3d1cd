"""The autoscaling hint: ``offpeak_replicas_needed{model}``, the engines that
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
from offpeak.model_config import CPU_MAX_NUM_SEQS
from offpeak.settings import ModelConfig, Settings
from storage.db import session_scope
from storage.models import Batch
from tests.integration import test_scheduler as scheduler_tests
from tests.integration.test_scheduler import chat, make_batch, with_policy
from workers.scheduler.slack import sweep_estimates

model = scheduler_tests.model
settings = scheduler_tests.settings
endpoint = scheduler_tests.endpoint
tenant = scheduler_tests.tenant


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
    at the default step model (10 ms + 0.4 ms per sequence: 16 / 16.4 ms = 976 tokens/s): 400,000
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
    4 engines of 128 sequences (2,092 tokens/s each at the default step model); 2 can share
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
