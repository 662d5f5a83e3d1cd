"""The engine worker's stop and its one process slot (``workers.engine_worker``)."""

from __future__ import annotations

from types import SimpleNamespace

from workers import engine_worker
from workers.engine import registry
from workers.engine_worker import EngineWorker


class Closing:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_stop_closes_every_loaded_engine_and_the_release_check_once() -> None:
    engines = {"a": Closing(), "b": Closing()}
    registry._engines.update(engines)  # type: ignore[arg-type]
    worker = EngineWorker(SimpleNamespace())  # type: ignore[arg-type]
    stopped: list[bool] = []
    worker.release_check = SimpleNamespace(stop=lambda: stopped.append(True))  # type: ignore[assignment]
    worker.stop(None)
    worker.stop(None)  # Celery's shutdown, then the command's exit: the second finds nothing
    assert [e.closed for e in engines.values()] == [1, 1] and registry.loaded() == {}
    assert stopped == [True, True]


def test_the_drain_task_finds_the_installed_worker() -> None:
    mine = EngineWorker(SimpleNamespace())  # type: ignore[arg-type]
    previous = engine_worker.install(mine)
    try:
        assert engine_worker.current() is mine
    finally:
        engine_worker.install(previous)
