"""The runner under the batch lane on the database: it follows the lane's limit and aborts lines
back to pending."""

from __future__ import annotations

import math
import threading
import time

import pytest
from sqlalchemy import select

from offpeak.settings import LaneSettings, ModelConfig, SchedulerSettings, Settings
from storage.db import session_scope
from storage.models import RequestLine
from tests.support.batches import line, tenant_client, validate
from workers.engine.base import EngineRequest, EngineResult
from workers.engine.instant import InstantEngine
from workers.planner import StepModel
from workers.runner import Runner
from workers.vllm_metrics import Histogram, ServerSnapshot

BOUNDS = (0.01, 0.02, 0.04, 0.08, math.inf)


MODEL = "lane-model"


class HoldingEngine(InstantEngine):
    """Keeps every request for ``steps`` steps (a long decode), records the most in flight."""

    def __init__(self, model_name: str, steps: int = 20) -> None:
        super().__init__(model_name)
        self.steps, self.age = steps, dict[str, int]()
        self.most = 0
        self.aborted: list[str] = []

    def add(self, request: EngineRequest) -> None:
        super().add(request)
        self.age[request.request_id] = 0
        self.most = max(self.most, len(self._queued))

    def step(self) -> list[EngineResult]:
        time.sleep(0.005)
        for rid in self.age:
            self.age[rid] += 1
        done = {r for r, a in self.age.items() if a >= self.steps}
        keep = {r: q for r, q in self._queued.items() if r not in done}
        self._queued = {r: q for r, q in self._queued.items() if r in done}
        results = super().step()
        self._queued = keep
        for r in done:
            del self.age[r]
        return results

    def abort(self, request_ids: list[str]) -> None:
        super().abort(request_ids)
        self.aborted += request_ids
        for r in request_ids:
            self.age.pop(r, None)


class ScriptedMetrics:
    """A server that is inside the targets until ``breach`` is set, then far above them."""

    def __init__(self, engine: HoldingEngine) -> None:
        self.engine, self.breach = engine, threading.Event()
        self.tpot = [0.0] * len(BOUNDS)

    def read(self) -> ServerSnapshot:
        running = self.engine.num_unfinished()
        self.tpot[3 if self.breach.is_set() else 0] += 50
        counts = tuple(sum(self.tpot[: i + 1]) for i in range(len(BOUNDS)))
        return ServerSnapshot(time.monotonic(), Histogram(BOUNDS, counts), None, running, 0.0)


@pytest.fixture()
def lane_settings(settings: Settings) -> Settings:
    policy = SchedulerSettings(
        lane=LaneSettings(
            enabled=True,
            control_seconds=0.05,
            window_seconds=0.2,
            learn_seconds=0.0,
            tpot_p95_ms=30.0,
            additive_increase=2,
            min_tokens=10,
        )
    )
    return settings.model_copy(
        update={
            "models": {MODEL: ModelConfig(engine="instant", max_num_seqs=16)},
            "flush_seconds": 0.05,
            "scheduler": policy,
        }
    )


def test_runner_follows_the_lane_and_aborts_back_to_pending(lane_settings: Settings) -> None:
    tenant, _ = tenant_client(lane_settings)
    lines = [line(f"r{i}", model=MODEL) for i in range(600)]  # more than 2 s of work
    batch, _ = validate(lane_settings, b"\n".join(lines), tenant_name=tenant)
    engine = HoldingEngine(MODEL, steps=40)
    metrics = ScriptedMetrics(engine)
    runner = Runner(
        lane_settings,
        engine,
        "lane-w1",
        lambda _b: None,
        step_model=StepModel(10.0, 5.0),  # 30 ms allows 4: the slow-start threshold
        lane_metrics=metrics,
    )
    timer = threading.Timer(2.0, metrics.breach.set)
    timer.start()
    try:
        # ``until`` is asked only when nothing runs: after the breach drove the lane to zero.
        stats = runner.run(until=lambda: metrics.breach.is_set() and runner.slots == 0)
    finally:
        timer.cancel()
    assert stats.outcome == "stopped" and stats.requests > 0
    decisions = list(runner.lane_decisions)
    assert decisions[0].action == "start" and decisions[0].limit == 1
    limits = [d.limit for d in decisions]
    assert max(limits) > 4  # grew inside the targets (up to max_num_seqs 16)
    assert engine.most <= max(limits)  # never more in flight than the lane allowed
    assert any(d.action == "decrease" for d in decisions) and limits[-1] == 0
    assert engine.aborted, "the breach aborted running lines"
    with session_scope(lane_settings.resolved_database_url) as session:
        rows = session.execute(
            select(RequestLine.status, RequestLine.attempts).where(RequestLine.batch_id == batch.id)
        ).all()
    statuses = {s for s, _ in rows}
    assert "failed" not in statuses and "pending" in statuses
    assert all(a == 0 for s, a in rows if s == "pending")  # an abort is not an attempt
