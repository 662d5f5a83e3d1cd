"""The drain's baton: while lines wait, a drain queues the next one; after drains that claimed
nothing (a closed gate, lines locked by another host's stalled claim) that next one waits, so
the model's queue does not spin."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import pytest

from workers import engine_worker
from workers.runner.stats import DrainStats


def test_the_baton_waits_longer_after_each_empty_drain_up_to_the_sweep() -> None:
    delays = [engine_worker.baton_delay(n, 10.0) for n in range(8)]
    assert delays == [None, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert engine_worker.baton_delay(10_000, 10.0) == 10.0


def test_drains_that_claim_nothing_pass_a_waiting_baton_and_work_resets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    claims = iter([0, 0, 0, 3, 0])
    sent: list[float | None] = []

    class Runner:
        gate = SimpleNamespace(reason="paused")
        engine = None

        def drain(self) -> DrainStats:
            return DrainStats(chunks=next(claims), outcome="yielded")

    settings = SimpleNamespace(
        resolved_database_url="unused",
        sweep_seconds=10.0,
        scheduler=SimpleNamespace(release_after_seconds=0),
    )
    monkeypatch.setattr(engine_worker, "session_scope", lambda _url: nullcontext(None))
    monkeypatch.setattr(engine_worker.requests_repo, "has_pending", lambda _session, _model: True)

    def send_drain(_settings: Any, _model: str, countdown: float | None = None) -> None:
        sent.append(countdown)

    monkeypatch.setattr(engine_worker.task_messages, "send_drain", send_drain)
    worker = engine_worker.EngineWorker(settings)  # type: ignore[arg-type]
    worker.runners["m"] = Runner()  # type: ignore[assignment]
    for _ in range(5):
        worker.drain("m")
    # At once, then waiting longer after each empty drain; a drain that claimed resets it.
    assert sent == [None, 0.25, 0.5, 1.0, None]
