"""Releasing an engine while the gate is closed, without the real engine:
when it is released and brought back (``workers.engine.release``), and how the reload moves the
slack. ``tests/e2e/live/test_release.py`` does it with vLLM on the live stack."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest
from openai import OpenAI
from prometheus_client import REGISTRY

from offpeak.settings import Settings
from tests.integration import test_scheduler as scheduler_tests
from tests.integration.test_scheduler import chat, end, make_batch, with_policy
from tests.support.batches import line_statuses
from tests.support.scheduler import MetricsEndpoint
from workers.engine import registry
from workers.engine.base import EngineRequest, SamplingSpec
from workers.engine.release import (
    ReleasableEngine,
    releasable,
    release_if_held_back,
    startup_seconds,
)
from workers.engine.release_check import ReleaseCheck
from workers.planner import StepModel
from workers.runner import Runner
from workers.scheduler.gate import Gate
from workers.scheduler.signals import LoadReading

# The scheduler tests' fixtures: a model and a pool of the test's own, a Prometheus endpoint
# whose load the test sets, a tenant with an SDK on the in-process API.
model = scheduler_tests.model
settings = scheduler_tests.settings
endpoint = scheduler_tests.endpoint
tenant = scheduler_tests.tenant


@pytest.fixture()
def engine(settings: Settings, model: str) -> Iterator[ReleasableEngine]:
    """The registry's (instant) engine of the test's model, releasable, as a worker wraps it."""
    wrapped = ReleasableEngine(settings, registry.load(settings, model), load_seconds=40.0)
    yield wrapped
    registry.discard(model)


def reload_count(model: str) -> float:
    value = REGISTRY.get_sample_value(
        "offpeak_worker_engine_reload_seconds_count", {"model": model, "how": "load"}
    )
    return value or 0.0


def test_released_after_the_gate_stays_closed_and_back_on_the_first_add(
    settings: Settings, model: str, engine: ReleasableEngine
) -> None:
    settings = with_policy(settings, release_after_seconds=30.0)
    gate = Gate(0.3, 0.6)
    gate.update(LoadReading(at=1000.0, load=0.1))
    assert not release_if_held_back(engine, gate, settings, 2000.0), "open gate: keep it"
    gate.update(LoadReading(at=1010.0, load=0.9))
    gate.update(LoadReading(at=1020.0, load=0.5))  # still closed (hysteresis): since 1010
    assert gate.closed_since == 1010.0
    assert not release_if_held_back(engine, gate, settings, 1039.0), "closed 29 s < 30 s"
    assert not engine.released and registry.loaded().get(model) is engine.inner
    assert startup_seconds(engine) == 0.0
    assert release_if_held_back(engine, gate, settings, 1040.0)
    assert engine.released and model not in registry.loaded(), "the engine was not closed"
    assert startup_seconds(engine) == 40.0, "the reload estimate before any reload: the load"
    assert not release_if_held_back(engine, gate, settings, 1100.0), "released once"
    # Released: nothing in flight, steps are empty, tokenizing needs no engine.
    assert engine.num_unfinished() == 0 and engine.step() == []
    ids = engine.encode_text("Hello")
    assert ids and model not in registry.loaded()
    before = reload_count(model)
    engine.add(EngineRequest("r1", ids, SamplingSpec(max_tokens=4)))
    assert not engine.released and model in registry.loaded(), "add did not bring it back"
    assert reload_count(model) == before + 1
    assert 0 <= engine.reload_seconds < 40.0, "the measured reload replaces the estimate"
    assert [r.request_id for r in engine.step()] == ["r1"]


def test_never_released_with_work_in_flight_or_when_off(
    settings: Settings, model: str, engine: ReleasableEngine
) -> None:
    gate = Gate(0.3, 0.6)
    gate.update(LoadReading(at=0.0, load=0.9))
    engine.add(EngineRequest("r1", engine.encode_text("Hi"), SamplingSpec(max_tokens=4)))
    on = with_policy(settings, release_after_seconds=1.0)
    assert not release_if_held_back(engine, gate, on, 100.0), "a request is in flight"
    engine.step()
    for off in (None, 0.0):
        assert not release_if_held_back(
            engine, gate, with_policy(settings, release_after_seconds=off), 100.0
        )
    assert release_if_held_back(engine, gate, on, 100.0)
    # Only in-process vLLM engines are wrapped, and only where the pool releases engines.
    instant = registry.load(settings, model)
    assert releasable(on, instant, 1.0) is instant  # the instant engine holds no memory
    vllm_settings = on.model_copy(
        update={"models": {model: settings.models[model].model_copy(update={"engine": "vllm"})}}
    )
    assert isinstance(releasable(vllm_settings, instant, 1.0), ReleasableEngine)
    assert releasable(with_policy(vllm_settings, release_after_seconds=0), instant, 1) is instant


def test_a_released_engines_batch_turns_urgent_early_enough_and_runs(
    settings: Settings,
    model: str,
    tenant: tuple[str, OpenAI],
    endpoint: MetricsEndpoint,
    engine: ReleasableEngine,
) -> None:
    """Under high load, a 60 s batch the loaded engine finishes with slack to spare waits; the
    same batch with the engine released needs the reload (40 s) first: it turns urgent, the
    engine comes back and the batch runs."""
    name, sdk = tenant
    # Fallback throughput: 16 slots per 1 s step = 16 tokens/s; 10 lines x 10 tokens take
    # ~6 s of a 60 s window. Margin 20 s: slack ~54 s without the reload, ~14 s with it.
    settings = with_policy(
        settings,
        urgent_margin_fraction=0.0,
        urgent_margin_seconds=20.0,
        expected_completion_tokens=10,
        release_after_seconds=1.0,
    )
    ids = [f"u{i}" for i in range(10)]
    batch_id = make_batch(settings, name, [chat(model, i, "Hi", 10) for i in ids], "60s")
    endpoint.set(waiting=20)  # load 2.0: the gate is closed
    runner = Runner(
        settings,
        engine,
        f"w-release-{secrets.token_hex(2)}",
        step_model=StepModel(base_ms=1000, per_seq_ms=0),
    )
    stats = runner.drain()
    assert stats.outcome == "yielded" and stats.requests == 0
    assert batch_id not in runner.urgent_seen, "loaded: enough slack, it waits for the load"
    assert runner.estimates[batch_id].slack_seconds > 40
    time.sleep(1.1)
    assert release_if_held_back(engine, runner.gate, settings, time.time())
    stats = runner.drain()
    assert batch_id in runner.urgent_seen, "the reload did not count in the slack"
    assert stats.requests == 10 and not engine.released
    assert line_statuses(settings, batch_id) == {"succeeded": 10}
    assert end(settings, sdk, batch_id, ids).status == "completed"


def test_an_idle_models_engine_is_released_by_the_workers_own_check(
    settings: Settings,
    model: str,
    tenant: tuple[str, OpenAI],
    endpoint: MetricsEndpoint,
    engine: ReleasableEngine,
) -> None:
    """The model's only batch ended with the gate open, so no drain comes any more: the
    worker's check releases the engine once the gate has been closed long enough, leaves it
    alone while a drain runs, and with ``release_idle_after_seconds`` releases an engine idle
    that long with the gate open."""
    name, sdk = tenant
    settings = with_policy(settings, release_after_seconds=60.0)
    ids = [f"i{i}" for i in range(3)]
    batch_id = make_batch(settings, name, [chat(model, i, "Hi", 4) for i in ids], "60s")
    endpoint.set(waiting=0)
    runner = Runner(settings, engine, f"w-idle-{secrets.token_hex(2)}",
                    step_model=StepModel(base_ms=10, per_seq_ms=0))  # fmt: skip
    assert runner.drain().requests == 3
    assert end(settings, sdk, batch_id, ids).status == "completed"
    release_check = ReleaseCheck(settings, lambda: {model: runner}, every=60.0)
    assert release_check.check() == [] and not engine.released, "gate open, idle release off"
    endpoint.set(waiting=20)  # the gate closes; with no batch, no drain reads it
    deadline = time.monotonic() + 30
    while runner.gate.open:
        assert time.monotonic() < deadline, "the check never read the load"
        assert release_check.check() == []  # closed for less than release_after_seconds
        time.sleep(0.2)
    later = time.time() + 61.0
    with release_check.busy(model):
        assert release_check.check(at=later) == [], "a drain holds the engine"
    assert release_check.check(at=later) == [model]
    assert engine.released and model not in registry.loaded()
    # Gate open again, the engine back; idle 31 s past a 30 s idle limit: released again.
    endpoint.set(waiting=0)
    engine.restore()
    idle = ReleaseCheck(with_policy(settings, release_idle_after_seconds=30.0),
                        lambda: {model: runner}, every=60.0)  # fmt: skip
    now = time.monotonic()
    assert idle.check(now=now) == [] and not engine.released
    deadline = time.monotonic() + 30
    while not runner.gate.open:
        assert time.monotonic() < deadline, "the check never read the load"
        idle.check(now=now)
        time.sleep(0.2)
    assert idle.check(now=now + 31.0) == [model] and engine.released
