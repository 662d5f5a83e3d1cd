"""A fleet of real-time replicas as one engine: lines to the replica with room under its own
lane's limit, a replica that goes away hands its lines to the others (no result lost, none
twice), a new one joins; and the per-replica lanes the runner steers it with."""

from __future__ import annotations

from collections import deque

import pytest

from offpeak.settings import ModelConfig, SchedulerSettings
from tests.support.fake_vllm import FakeServer
from workers.engine.base import Completion, EngineFault, EngineRequest, EngineResult, SamplingSpec
from workers.engine.fleet import FleetEngine, candidates, resolve
from workers.engine.remote_meter import ServerUsage
from workers.lane.fleet_steering import FleetSteering, steering_for
from workers.planner import StepModel
from workers.vllm_metrics import ServerTokens


class FakeReplica:
    """What the fleet uses of a ``RemoteEngine``: lines finish when ``finish`` says so."""

    def __init__(self, url: str) -> None:
        self.base_url, self.max_model_len = url, 2048
        self.lines: deque[EngineRequest] = deque()
        self.done: list[str] = []
        self.fault: EngineFault | None = None
        self.closed = False
        self.server_meter = self
        self.busy = 0.0

    def usage(self) -> ServerUsage:
        return ServerUsage(self.busy, ServerTokens(10, 0, 5))

    def set_max_in_flight(self, limit: int) -> None:
        pass

    def add(self, request: EngineRequest) -> None:
        self.lines.append(request)

    def num_unfinished(self) -> int:
        return len(self.lines)

    def in_flight_ids(self) -> list[str]:
        return [r.request_id for r in self.lines]

    def finish(self, n: int) -> None:
        for _ in range(n):
            self.done.append(self.lines.popleft().request_id)

    def step(self) -> list[EngineResult]:
        if self.fault is not None:
            raise self.fault
        out = [EngineResult(rid, 3, 0, [Completion("x", [1], "stop")]) for rid in self.done]
        self.done = []
        return out

    def abort(self, ids: list[str]) -> None:
        self.lines = deque(r for r in self.lines if r.request_id not in ids)

    def take_unfinished(self) -> list[EngineRequest]:
        taken, self.lines = list(self.lines), deque()
        return taken

    def close(self) -> None:
        self.closed = True


def line(i: int) -> EngineRequest:
    return EngineRequest(f"r{i}", [1, 2, 3], SamplingSpec(max_tokens=4))


@pytest.fixture
def fleet() -> tuple[FleetEngine, dict[str, FakeReplica]]:
    made: dict[str, FakeReplica] = {}

    def build(url: str) -> FakeReplica:
        made[url] = FakeReplica(url)
        return made[url]

    config = ModelConfig(engine="remote", url="http://a:8000", urls=["http://b:8000"],
                         max_num_seqs=4)  # fmt: skip
    engine = FleetEngine("m", config, None, build=build)  # type: ignore[arg-type]
    for url in candidates(config):
        engine._try_join(url)
    engine._take_joined()
    return engine, made


def test_lines_go_to_the_replica_with_room_under_its_limit(fleet) -> None:  # type: ignore[no-untyped-def]
    engine, made = fleet
    assert engine.replica_urls() == ["http://a:8000", "http://b:8000"]
    assert engine.capabilities.max_num_seqs == 8
    engine.set_replica_limits({"http://a:8000": 1, "http://b:8000": 3})
    for i in range(6):
        engine.add(line(i))
    assert [len(made[u].lines) for u in ("http://a:8000", "http://b:8000")] == [1, 3]
    assert engine.num_unfinished() == 6 and engine.replica_of("r5") is None
    b = made["http://b:8000"]
    first_two = [r.request_id for r in b.lines][:2]
    b.finish(2)
    assert sorted(r.request_id for r in engine.step()) == sorted(first_two)
    assert len(b.lines) == 3 and engine.num_unfinished() == 4  # refilled from the queue
    assert engine.sent_to == {"http://a:8000": 1, "http://b:8000": 5}
    with pytest.raises(ValueError):
        engine.add(line(5))


def test_a_replica_that_goes_away_hands_its_lines_to_the_others(fleet) -> None:  # type: ignore[no-untyped-def]
    engine, made = fleet
    a, b = made["http://a:8000"], made["http://b:8000"]
    b.busy = 7.0
    engine.set_replica_limits({"http://a:8000": 2, "http://b:8000": 2})
    for i in range(4):
        engine.add(line(i))
    b.fault = EngineFault("b went away", blameless=True)
    assert engine.step() == []
    assert engine.replica_urls() == ["http://a:8000"] and b.closed
    # b's two lines wait for room on a, ahead of later ones, none lost.
    engine.add(line(9))
    engine.set_replica_limits({"http://a:8000": 5})
    assert [r.request_id for r in a.lines] == ["r0", "r2", "r1", "r3", "r9"]
    a.finish(5)
    assert sorted(r.request_id for r in engine.step()) == ["r0", "r1", "r2", "r3", "r9"]
    # b's usage stays counted after it left (its share was billed once, not dropped).
    assert engine.server_meter.usage().busy_seconds == 7.0
    a.fault = EngineFault("a too", blameless=True)
    engine.add(line(10))
    with pytest.raises(EngineFault) as caught:
        engine.step()
    assert caught.value.blameless and caught.value.suspects == ["r10"]


def test_a_line_fault_is_raised_and_a_new_replica_joins(fleet) -> None:  # type: ignore[no-untyped-def]
    engine, made = fleet
    engine.add(line(0))
    made["http://a:8000"].fault = EngineFault("500 for r0")
    with pytest.raises(EngineFault, match="500"):
        engine.step()
    engine._try_join("http://c:8000")
    made["http://a:8000"].fault = None
    engine.step()
    assert "http://c:8000" in engine.replica_urls()
    engine.close()
    assert all(r.closed for r in made.values()) and engine.replica_urls() == []


def test_discovery_resolves_a_name_to_every_address() -> None:
    assert resolve("http://127.0.0.1:8000/") == ["http://127.0.0.1:8000"]
    assert resolve("http://no-such-host.invalid:8000") == []
    config = ModelConfig(engine="remote", url="http://localhost:9000", discover=True,
                         max_replicas=1)  # fmt: skip
    assert len(candidates(config)) == 1 and config.is_fleet
    assert not ModelConfig(engine="remote", url="http://a").is_fleet


def test_each_replica_has_its_own_lane(fleet) -> None:  # type: ignore[no-untyped-def]
    engine, _made = fleet
    servers = {"http://a:8000/metrics": FakeServer(), "http://b:8000/metrics": FakeServer()}
    servers["http://b:8000/metrics"].realtime = 30  # b is busy with real-time work
    policy = SchedulerSettings.model_validate(
        {"lane": {"learn_seconds": 0, "control_seconds": 1, "window_seconds": 3,
                  "tpot_p95_ms": 40, "ttft_p95_ms": 1000}}
    )  # fmt: skip
    config = ModelConfig(engine="remote", url="http://a:8000", urls=["http://b:8000"],
                         max_num_seqs=64)  # fmt: skip

    class Reader:
        def __init__(self, url: str) -> None:
            self.server = servers[url]

        def read(self):  # type: ignore[no-untyped-def]
            mine = sum(1 for rid in running if engine.replica_of(rid) == self.url)
            return self.server.advance(1.0, mine)

    def scraper(url: str) -> Reader:
        reader = Reader(url)
        reader.url = url.removesuffix("/metrics")  # type: ignore[attr-defined]
        return reader

    steering = FleetSteering(lambda: engine, policy, config, StepModel(10.0, 2.0), "m", scraper)
    assert isinstance(
        steering_for(engine, lambda: engine, policy, config, 8, StepModel(), None, "m"),
        FleetSteering,
    )
    running: dict[str, str] = {}
    n = 0
    for t in range(12):
        limit, doomed = steering.steer(float(t), running, False, lambda _b: False)
        for rid in doomed:
            running.pop(rid)
        engine.abort(doomed)
        while len(running) < limit:
            engine.add(line(n))
            running[f"r{n}"] = "batch"
            n += 1
    lanes = steering.lanes
    # The quiet replica took batch work; the busy one (30 real-time users at 70 ms) none.
    assert lanes["http://a:8000"].limit > 1 and lanes["http://b:8000"].limit == 0
    assert steering.limit == lanes["http://a:8000"].limit
    assert all(engine.replica_of(r) == "http://a:8000" for r in running if engine.replica_of(r))
