"""The batch lane's controller (``workers.lane.controller``): windowed p95s from Prometheus bucket
deltas, the AIMD decisions on made-up server readings, and the runner following the limit on a
real database with a stand-in engine (the tests are about admission, not the model)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client import Histogram as PromHistogram

from offpeak.settings import LaneSettings
from tests.support.fake_vllm import BOUNDS, FakeServer, hist
from workers.lane.controller import LaneController, victims
from workers.planner import StepModel
from workers.vllm_metrics import Histogram, ServerSnapshot, parse_snapshot


def test_quantile_interpolates_inside_the_bucket() -> None:
    h = hist(0, 100, 0, 0, 0)  # every observation in (10 ms, 20 ms]
    assert h.quantile(0.5) == pytest.approx(0.015)
    assert h.quantile(0.95) == pytest.approx(0.0195)
    assert hist(0, 0, 0, 0, 5).quantile(0.95) == 0.08  # +Inf: the highest finite bound
    assert hist(0, 0, 0, 0, 0).quantile(0.95) is None
    # The lane's own 10 first tokens are the slowest: taken out, the real-time p95 is left.
    mixed = hist(0, 90, 0, 10, 0)
    assert mixed.quantile(0.95) > 0.04 and mixed.quantile(0.95, drop_top=10) <= 0.02
    assert mixed.quantile(0.95, drop_top=100) is None


def test_deltas_window_and_reset() -> None:
    old, new = hist(50, 0, 0, 0, 0), hist(50, 0, 0, 10, 0)
    delta = new.minus(old)
    assert delta.count == 10 and delta.quantile(0.95) > 0.04
    assert hist(1, 0, 0, 0, 0).minus(new) == hist(1, 0, 0, 0, 0)  # server restarted


def test_parse_snapshot_of_vllm_names() -> None:
    registry = CollectorRegistry()
    itl = PromHistogram(
        "vllm:inter_token_latency_seconds", "", ["engine"], buckets=BOUNDS[:-1], registry=registry
    )
    ttft = PromHistogram(
        "vllm:time_to_first_token_seconds", "", ["engine"], buckets=BOUNDS[:-1], registry=registry
    )
    running = Gauge("vllm:num_requests_running", "", ["engine"], registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "", ["engine"], registry=registry)
    for engine in ("0", "1"):  # two engines behind one endpoint are summed
        for _ in range(10):
            itl.labels(engine).observe(0.015)
        ttft.labels(engine).observe(0.05)
        running.labels(engine).set(3)
        waiting.labels(engine).set(1)
    snap = parse_snapshot(generate_latest(registry).decode(), at=5.0)
    assert snap.at == 5.0 and snap.running == 6 and snap.waiting == 2
    assert snap.tpot is not None and snap.tpot.count == 20
    assert snap.ttft is not None and snap.ttft.quantile(0.5) == pytest.approx(0.06)
    with pytest.raises(ValueError, match="inter_token_latency"):
        parse_snapshot("vllm:num_requests_running 1\n", at=0.0)


def lane(**changes: object) -> LaneSettings:
    base = {"control_seconds": 1.0, "window_seconds": 3.0, "learn_seconds": 2.0}
    return LaneSettings.model_validate(base | changes)


def drive(controller: LaneController, server: FakeServer, steps: int) -> list[str]:
    actions = []
    for _ in range(steps):
        snap = server.advance(1.0, controller.limit)
        actions.append(controller.update(server.at, snap, controller.limit, urgent=False).action)
    return actions


def test_learns_baselines_then_starts_at_the_step_model() -> None:
    server = FakeServer()
    controller = LaneController(lane(), max_num_seqs=64, step_model=StepModel(10.0, 2.0))
    actions = drive(controller, server, 3)
    assert actions[0] == "learning" and controller.limit > 0 and "start" in actions
    # Baseline: 2 real-time sequences alone -> 14 ms steps (the mean inter-token latency).
    assert controller.baseline_tpot() == pytest.approx(0.014)
    assert controller.tpot_target() == pytest.approx(2.4 * controller.baseline_tpot())
    assert controller.ttft_target() is not None


def test_aimd_settles_inside_the_target_and_halves_on_a_breach() -> None:
    server = FakeServer()
    settings = lane(tpot_p95_ms=40.0, ttft_p95_ms=160.0, learn_seconds=0.0)
    controller = LaneController(settings, max_num_seqs=64, step_model=StepModel(10.0, 0.5))
    drive(controller, server, 1)
    assert controller.limit == 1  # slow start
    # The step model is optimistic (0.5 ms per sequence: 58 batch lines; the server costs
    # 2 ms): the feedback stops the slow start inside the target.
    drive(controller, server, 40)
    running = server.realtime + controller.limit
    assert server.base + server.per_seq * running <= 0.04  # inside the target
    assert controller.limit >= 4  # and not starved: 40 ms allows 13 sequences, 11 batch
    server.realtime += 6  # more real-time users: the same lane now breaches
    before = controller.limit
    actions = drive(controller, server, 1)
    assert actions == ["decrease"] and controller.limit == before // 2
    drive(controller, server, 40)
    running = server.realtime + controller.limit
    assert server.base + server.per_seq * running <= 0.04 and controller.limit >= 2
    server.waiting = 3  # real-time requests queue at the server
    first = controller.limit
    decision = controller.update(server.at + 1, server.advance(1, first), first, urgent=False)
    assert decision.action != "decrease"  # one reading could be a request between two steps
    before = controller.limit
    decision = controller.update(server.at + 1, server.advance(1, before), before, urgent=False)
    assert decision.action == "decrease" and decision.limit == before // 2
    assert "waiting" in decision.reason


def test_increase_needs_the_lane_to_use_its_limit_and_stops_at_free_slots() -> None:
    server = FakeServer(per_seq=0.0)
    settings = lane(tpot_p95_ms=1000.0, ttft_p95_ms=1000.0, learn_seconds=0.0)
    controller = LaneController(settings, max_num_seqs=10, step_model=StepModel(10.0, 0.0))
    drive(controller, server, 4)
    assert controller.limit == 5  # slow start: 1, 2, 3, 5
    for _ in range(4):  # only 1 line in flight: no reason to grow
        snap = server.advance(1.0, 1)
        assert controller.update(server.at, snap, 1, urgent=False).action == "hold"
    drive(controller, server, 10)
    assert controller.limit == 8  # never more than the free slots: no queueing there


class RequestTpotServer(FakeServer):
    """A ``FakeServer`` that also exposes finished requests' own TPOT: four requests an interval
    at ``request_tpot`` seconds (set from outside), whatever the mean step says."""

    def __init__(self) -> None:
        super().__init__(per_seq=0.0)  # the mean step never moves: only the requests' does
        self.request_tpot = 0.012
        self.requests = [0.0] * len(BOUNDS)

    def advance(self, seconds: float, in_flight: int) -> ServerSnapshot:
        snap = super().advance(seconds, in_flight)
        i = next(i for i, b in enumerate(BOUNDS) if self.request_tpot <= b)
        self.requests[i] += 4
        counts = tuple(sum(self.requests[: k + 1]) for k in range(len(BOUNDS)))
        return ServerSnapshot(snap.at, snap.tpot, snap.ttft, snap.running, snap.waiting,
                              Histogram(BOUNDS, counts))  # fmt: skip


def test_requests_own_tpot_p95_is_held_too() -> None:
    server = RequestTpotServer()
    controller = LaneController(lane(learn_seconds=4.0, request_tpot=True), max_num_seqs=64)
    drive(controller, server, 12)
    assert controller.baseline_request_tpot() is not None
    assert controller.request_tpot_target() == pytest.approx(
        2.4 * controller.baseline_request_tpot()
    )
    grown = controller.limit
    assert grown > 1  # inside every target: the lane grew
    server.request_tpot = 0.07  # the users' own TPOT p95 passes 2.4x its baseline
    actions = drive(controller, server, 3)
    assert "decrease" in actions and controller.limit < grown
    decision = controller.update(server.at + 1, server.advance(1, controller.limit),
                                 controller.limit, urgent=False)  # fmt: skip
    assert decision.request_tpot_p95 is not None and decision.request_tpot_p95 > 0.04
    off = LaneController(lane(learn_seconds=4.0, request_tpot=False), max_num_seqs=64)
    server = RequestTpotServer()
    drive(off, server, 12)
    server.request_tpot = 0.07
    assert "decrease" not in drive(off, server, 3)  # the switch turns the signal off


def test_urgent_minimum_and_unreadable_server() -> None:
    server = FakeServer(per_seq=0.05)  # every batch line breaches
    settings = lane(tpot_p95_ms=20.0, learn_seconds=0.0, urgent_min=2, stale_seconds=3.0)
    controller = LaneController(settings, max_num_seqs=64, step_model=StepModel(10.0, 2.0))
    for _ in range(10):
        snap = server.advance(1.0, controller.limit)
        controller.update(server.at, snap, controller.limit, urgent=True)
    assert controller.limit == 2
    controller.limit = 5
    held = controller.update(server.at + 1, None, 5, urgent=False)
    assert held.action == "unreadable" and held.limit == 5  # holds while recent
    dropped = controller.update(server.at + 5, None, 5, urgent=True)
    assert dropped.limit == 2  # stale: the urgent minimum only


def test_victims_newest_first_urgent_last() -> None:
    running = {"1": "b_urgent", "2": "b_a", "3": "b_urgent", "4": "b_a"}
    assert victims(running, 2, lambda b: b == "b_urgent") == ["4", "2"]
    assert victims(running, 1, lambda b: b == "b_urgent") == ["4", "2", "3"]
    assert victims(running, 4, lambda b: False) == []


# --- The runner following the lane, on the real database ------------------------------------


def test_simulated_colocation_lane_keeps_the_floor_the_naive_lane_breaks_it() -> None:
    """The runner and the lane on the virtual clock against the simulated shared server (the
    default 10 ms + 0.4 ms step): with the lane, real-time TPOT p95 stays within 2.4x what it is
    alone and batch work still runs; without it (max_num_seqs in flight) it does not."""
    from workers.sim.colocate import ColocateParams, run_leg

    params = ColocateParams(phase_seconds=40.0, batch_lines=3000)
    alone, naive, lane_on = (run_leg(leg, params) for leg in ("a", "b", "c"))
    quiet_alone = alone.phases[0].tpot_p95
    assert quiet_alone is not None
    for phase in lane_on.phases:
        assert phase.tpot_p95 is not None and phase.tpot_p95 <= 2.4 * quiet_alone
    assert sum(p.batch_tokens_per_s for p in lane_on.phases) > 0
    assert all((p.tpot_p95 or 0) > 2.4 * quiet_alone for p in naive.phases)


def test_an_idle_server_gets_a_line_again_after_the_lane_fell_to_zero() -> None:
    """A replica with no real-time traffic: its one batch line stalled (no token for an
    interval), the lane fell to zero; with nothing running there, it starts again."""
    settings = lane(tpot_p95_ms=40.0, ttft_p95_ms=160.0, learn_seconds=0.0)
    controller = LaneController(settings, max_num_seqs=8, step_model=StepModel(10.0, 2.0))
    server = FakeServer()
    server.realtime = 0
    assert controller.update(0.0, server.snapshot(0), 0, urgent=False).action == "start"
    assert controller.limit == 1
    for t in (1.0, 2.0):  # one line in flight, not one token: stalled
        server.at = t
        decision = controller.update(t, server.snapshot(1), 1, urgent=False)
    assert decision.action == "decrease" and controller.limit == 0
    server.at = 3.0
    decision = controller.update(3.0, server.snapshot(0), 0, urgent=False)
    assert decision.action == "increase" and controller.limit == 1
