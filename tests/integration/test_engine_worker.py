"""The engine worker (``workers.engine_worker.EngineWorker``) under the drain task: it builds
each served model's runner once, before work, and rebuilds a failed engine into the same
runner, exiting for its supervisor after too many failures. On real PostgreSQL, with engines
that fail on purpose (``tests.integration.test_engine_faults``); each test installs an
``EngineWorker`` of its own."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from openai import OpenAI

from offpeak.settings import ModelConfig, Settings
from tests.integration.test_engine_faults import MODEL, DyingEngine, rows
from tests.integration.test_runner import make
from tests.support.batches import line, tenant_client
from workers.engine.base import EngineFault
from workers.engine_worker import EXIT_ENGINE_BROKEN, EngineWorker


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"models": {MODEL: ModelConfig(engine="instant")}, "flush_seconds": 0.05}
    )


@pytest.fixture()
def tenant_sdk(settings: Settings) -> tuple[str, OpenAI]:
    return tenant_client(settings)


@pytest.fixture()
def sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The models drains were sent for; finalizes are dropped (no broker in these tests)."""
    from storage import task_messages

    drains: list[str] = []
    monkeypatch.setattr(task_messages, "send_drain", lambda _s, model, **_k: drains.append(model))
    monkeypatch.setattr(task_messages, "send_finalize", lambda _s, _b, **_k: None)
    return drains


@pytest.fixture()
def installed() -> Iterator[Callable[[EngineWorker], EngineWorker]]:
    """Makes an ``EngineWorker`` the process's for the test (the drain task finds it)."""
    from workers import engine_worker

    def install(worker: EngineWorker) -> EngineWorker:
        engine_worker.install(worker)
        return worker

    previous = engine_worker.install(None)
    yield install
    engine_worker.install(previous)


def test_the_drain_task_rebuilds_a_failed_engine(
    settings: Settings,
    tenant_sdk: tuple[str, OpenAI],
    sent: list[str],
    installed: Callable[[EngineWorker], EngineWorker],
) -> None:
    """``drain_model``: an ``EngineFault`` closes the engine, loads a new one into the same
    runner and sends another drain; too many failures exit the process for its supervisor."""
    from workers import tasks

    loads: list[DyingEngine] = []
    exits: list[int] = []

    def load(_settings: Settings, _name: str) -> DyingEngine:
        engine = DyingEngine(lambda step, _queued: step == 3 and len(loads) == 1)
        loads.append(engine)
        return engine

    tenant, _ = tenant_sdk
    batch_id = make(settings, tenant, [line(f"r{i}", model=MODEL) for i in range(10)])
    worker = installed(EngineWorker(settings, load=load, device=lambda: "cpu", exit=exits.append))
    tasks.drain_model(MODEL)  # the first engine dies at its third step
    # One drain for a second worker (lines were pending as it started), one after the rebuild.
    assert len(loads) == 2 and sent == [MODEL, MODEL], "a new engine was loaded, a drain sent"
    assert worker.runners[MODEL].engine is loads[1]
    tasks.drain_model(MODEL)
    assert {r.status for r in rows(settings, batch_id)} == {"succeeded"}

    worker.failures[MODEL] = [time.monotonic()] * 10
    worker.recover(MODEL, EngineFault("dead again"))
    assert exits and exits[0] == EXIT_ENGINE_BROKEN


def test_the_engine_worker_builds_its_runners_before_it_takes_work(
    settings: Settings,
    tenant_sdk: tuple[str, OpenAI],
    sent: list[str],
    installed: Callable[[EngineWorker], EngineWorker],
) -> None:
    """``start_runners`` (the engine worker's start) loads each served model's engine and
    builds its runner once; the drains then use them, loading and looking up nothing."""
    from workers import tasks

    loads: list[str] = []
    lookups: list[str] = []

    def load(_settings: Settings, name: str) -> DyingEngine:
        loads.append(name)
        return DyingEngine(lambda _step, _queued: False)

    def device_name() -> str:
        lookups.append("cpu")
        return "cpu"

    tenant, _ = tenant_sdk
    served = settings.model_copy(update={"worker_models": MODEL})
    worker = installed(EngineWorker(served, load=load, device=device_name))
    worker.start_runners()
    assert loads == [MODEL] and lookups == ["cpu"] and list(worker.runners) == [MODEL]
    runner = worker.runners[MODEL]
    batch_id = make(settings, tenant, [line(f"r{i}", model=MODEL) for i in range(5)])
    tasks.drain_model(MODEL)
    assert loads == [MODEL] and lookups == ["cpu"], "the drain built nothing again"
    assert worker.runners[MODEL] is runner
    assert {r.status for r in rows(settings, batch_id)} == {"succeeded"}
