"""``workers.runner.claims.ClaimPipeline`` with claims made ahead on its claim threads, on the
simulation's store and engine: a claim that is done is queued at the next top-up even when the
held lines are full, so a batch whose lines it leased does not wait for the queue to drain."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

from offpeak.settings import ModelConfig, Settings
from storage.repositories.shared_claims import SharedClaim
from workers.engine.base import Engine
from workers.planner import StepModel
from workers.runner.claims import Claimed, ClaimPipeline
from workers.runner.held import HeldLines
from workers.runner.write_back import ResultWriter
from workers.scheduler.chunking import engine_room
from workers.scheduler.clock import VirtualClock
from workers.sim.engine import MODEL, SimEngine
from workers.sim.store import Arrival, MemoryStore

SLOTS = 128
START = 1_000_000.0


class HoldsTheSecondClaim(MemoryStore):
    """A store whose second shared claim waits for ``go`` before it reads anything: a
    claim slow to come back (a loaded database, or its lines slow to prepare)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls = 0
        self.holding, self.go = threading.Event(), threading.Event()

    def claim_shared(self, *args: Any, **kwargs: Any) -> SharedClaim:
        self.calls += 1
        if self.calls == 2:
            self.holding.set()
            assert self.go.wait(30)
        return super().claim_shared(*args, **kwargs)


def take_within(pipeline: ClaimPipeline, clock: VirtualClock, engine: Engine) -> Claimed:
    """The pipeline's next claim, on a clock that stands still (its claim threads run on the
    wall clock)."""
    deadline = time.monotonic() + 10
    while (claimed := pipeline.take(clock.time(), SLOTS, engine, ())) is None:
        assert time.monotonic() < deadline, "no claim came back"
        time.sleep(0.01)
    return claimed


def test_a_claim_done_while_the_queue_filled_is_queued_at_once() -> None:
    clock = VirtualClock(START)
    # SimEngine implements the Engine protocol.
    engine = cast(Engine, SimEngine(clock, StepModel(), max_num_seqs=SLOTS))
    big = Arrival(0.0, [([1, i % 250 + 1, 7], 8) for i in range(1200)], tenant="big")
    small = Arrival(1.0, [([2, i + 1, 7], 2) for i in range(5)], tenant="small")
    store = HoldsTheSecondClaim(clock, [big, small], "24h", START)
    settings = Settings(models={MODEL: ModelConfig(engine="instant", max_num_seqs=SLOTS)})
    held = HeldLines()
    writer = ResultWriter(settings, store, "worker", MODEL, "cpu", START, False)
    pipeline = ClaimPipeline(
        settings,
        store,
        MODEL,
        "worker",
        clock,
        held,
        writer,
        lambda: None,
        ahead=True,
        export_metrics=False,
    )
    room = engine_room(engine, settings.models.get(MODEL))

    def queue(claimed: Claimed) -> None:
        pipeline.queue(claimed, room, engine.max_model_len)
        held.admit(engine, SLOTS, lambda _b: True, lambda _h, _e: None)

    # The last drain's engine finished every line in a step: the queue is sized for that.
    pipeline.empties = True
    first = pipeline.take(clock.time(), SLOTS, engine, ())
    assert first is not None and len(first.rows) == SLOTS
    queue(first)
    taken = list(first.rows)
    # The rest of the queue is claimed ahead, before the small batch arrives; it is slow.
    pipeline.overlap_step(clock.time(), True, SLOTS, engine, ())
    assert store.holding.wait(10)
    pipeline.empties = False  # lines now run for several steps
    clock.advance(2.0)
    # A second claim starts beside the slow one and takes the small batch's lines.
    assert pipeline.take(clock.time(), SLOTS, engine, ()) is None
    store.go.set()
    rest = take_within(pipeline, clock, engine)
    taken += rest.rows
    queue(rest)
    assert len(held) == 1024 and pipeline.limit(SLOTS) == 0, "the queue is full"
    small_id = next(b.id for b in store.batches.values() if b.tenant == "small")
    later = take_within(pipeline, clock, engine)
    assert sum(row.batch_id == small_id for row in later.rows) == 5
    taken += later.rows
    assert len({row.id for row in taken}) == len(taken) == 1024 + len(later.rows), "a line twice"
    queue(later)
    # Queued ahead of the big batch's queue: the small batch runs in the next free slots.
    assert [h.row.batch_id for h in list(held.queued)[:5]] == [small_id] * 5
