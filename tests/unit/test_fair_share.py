"""The fair share's arithmetic (water filling over virtual time, tenants joining and leaving), the
held queue's place for a starting batch, and ``offpeak bench tenants`` at a tiny size on the
simulation's engine and store."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from sqlalchemy.exc import OperationalError
from typer.testing import CliRunner

from bench.tenants import TARGET_JAIN, Params, RecordingStore, completion, simulate
from offpeak.cli import app
from offpeak.settings import Settings
from offpeak.statuses import LineStatus
from storage.repositories.requests import ClaimedRequest
from storage.repositories.shared_claims import SharedClaim, WaitingBatch
from workers.engine.base import EngineRequest, SamplingSpec
from workers.engine_io import Prepared
from workers.runner.held import HeldLine, HeldLines
from workers.scheduler.clock import VirtualClock
from workers.scheduler.fair_share import Claimant, FairShare, water_fill
from workers.sim.store import Arrival


def test_water_fill_levels_the_least_served_first_within_caps() -> None:
    assert water_fill(16, [Claimant("a", 0, 1, 100), Claimant("b", 0, 1, 100)]) == {
        "a": 8,
        "b": 8,
    }
    assert water_fill(12, [Claimant("a", 0, 2, 100), Claimant("b", 0, 1, 100)]) == {
        "a": 8,
        "b": 4,
    }
    # b is 6 lines behind: it catches up first.
    assert water_fill(10, [Claimant("a", 6, 1, 100), Claimant("b", 0, 1, 100)]) == {
        "a": 2,
        "b": 8,
    }
    # a cap leaves its room to the others; caps that hold less than the total are all given.
    assert water_fill(16, [Claimant("a", 0, 1, 3), Claimant("b", 0, 1, 100)]) == {"a": 3, "b": 13}
    assert water_fill(16, [Claimant("a", 0, 1, 3), Claimant("b", 0, 1, 4)]) == {"a": 3, "b": 4}


def waiting(batch: str, tenant: str, left: int, weight: float = 1.0) -> WaitingBatch:
    return WaitingBatch(batch, tenant, weight, left, 2_000_000_000)


def rows(batch: str, n: int) -> list[ClaimedRequest]:
    return [ClaimedRequest(i, batch, f"c{i}", "{}", 1) for i in range(n)]


def test_a_tenant_joins_at_the_least_served_and_urgent_batches_come_first() -> None:
    fair = FairShare()
    fair.settle(SharedClaim(rows("a1", 100), [waiting("a1", "A", 1000)]))
    fair.settle(SharedClaim([], [waiting("a1", "A", 900), waiting("b1", "B", 5)]))
    # B joins at A's virtual time, not 100 lines behind it: an even split, B capped at 5.
    shares = fair.shares(16, urgent={"a2"})
    assert dict(shares.quotas) == {"a1": 11, "b1": 5}
    assert shares.urgent == ("a2",) and set(shares.known) == {"a1", "b1"}
    assert shares.fresh == 16 // 3
    # A tenant's batches split its share evenly.
    fair.settle(SharedClaim([], [waiting("a1", "A", 900), waiting("a2", "A", 900)]))
    assert dict(fair.shares(16, urgent=()).quotas) == {"a1": 8, "a2": 8}


def test_bench_tenants_at_a_tiny_size(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(
        app,
        ["bench", "tenants", "--big-tenants", "2", "--big-lines", "300",
         "--big-every", "0.5", "--small-batches", "1",
         "--small-from", "1", "--claim-lines", "0",
         "--out", str(tmp_path)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "tenants.json").read_text())
    fair, edf = report["fair"], report["edf"]
    assert fair["lines"] == edf["lines"] == 605
    assert fair["deadline_misses"] == 0
    assert max(fair["small_seconds"]) < max(edf["small_seconds"])
    # Both legs share the runner's queue, which puts the batches holding fewer lines first:
    # among backlogged big tenants it evens the engine out under either claim.
    assert fair["jain"] >= max(edf["jain"], TARGET_JAIN)


def held_line(row_id: int, batch: str, priority: int = 0) -> HeldLine:
    request = EngineRequest(str(row_id), [1], SamplingSpec(max_tokens=1), priority=priority)
    return HeldLine(
        ClaimedRequest(row_id, batch, f"c{row_id}", "{}", 1),
        Prepared(request, "/v1/chat/completions", "m", ((1, 1),)),
    )


def test_a_starting_batch_queues_ahead_of_other_batches_but_behind_urgent_lines() -> None:
    held = HeldLines()
    held.queue([held_line(1, "urgent", priority=-1), held_line(2, "a"), held_line(3, "a")])
    held.queue([held_line(4, "a"), held_line(5, "b"), held_line(6, "b")])
    assert [h.row.id for h in held.queued] == [1, 5, 6, 2, 3, 4]
    # A batch holding fewer lines than another queues ahead of that one's queued lines; the
    # one holding the most, at the back; an urgent line behind the urgent ones.
    held.queue([held_line(7, "b"), held_line(8, "a"), held_line(9, "a", priority=-1)])
    assert [h.row.id for h in held.queued] == [1, 9, 5, 6, 7, 2, 3, 4, 8]


def test_a_small_batchs_next_claim_queues_ahead_of_a_big_batchs_queue() -> None:
    """The small batch's first lines run (they went ahead, having none held); its next claim,
    made while they run, still goes ahead of the big batch's queued lines, not behind them."""
    held = HeldLines()
    held.queue([held_line(i, "big") for i in range(100)])
    for h in held.take_queued(lambda h: h.row.id < 50):
        held.running[h.request_id] = h
    held.queue([held_line(100, "small"), held_line(101, "small")])
    assert [h.row.id for h in held.queued][:2] == [100, 101]
    for h in held.take_queued(lambda h: h.row.batch_id == "small"):
        held.running[h.request_id] = h
    held.queue([held_line(102, "small"), held_line(103, "big"), held_line(104, "small")])
    order = [h.row.id for h in held.queued]
    assert order[:2] == [102, 104] and order[-1] == 103


class ClaimTimes(RecordingStore):
    """The simulation's store, recording when each batch's lines were first claimed."""

    def __init__(self, clock: VirtualClock, arrivals: list[Arrival]) -> None:
        super().__init__(clock, arrivals)
        self.first_claim: dict[str, float] = {}

    def claim(self, *args: Any, **kwargs: Any) -> list[ClaimedRequest]:
        return self._note(super().claim(*args, **kwargs))

    def claim_shared(self, *args: Any, **kwargs: Any) -> SharedClaim:
        claimed = super().claim_shared(*args, **kwargs)
        self._note(claimed.rows)
        return claimed

    def _note(self, rows: list[ClaimedRequest]) -> list[ClaimedRequest]:
        for row in rows:
            self.first_claim.setdefault(row.batch_id, self.clock.time())
        return rows


def test_a_full_queue_still_takes_a_new_batch_within_one_claim_cycle() -> None:
    # Long replies of mixed lengths: slots free one by one while the queue stays above the
    # refill mark, so no claim is due for many seconds after the small batch arrives.
    big = [([1, i % 250 + 1, 7], 200 + (i * 37) % 800) for i in range(1500)]
    small = [([2, i + 1, 7], 4) for i in range(5)]
    params = Params(max_num_seqs=64)
    arrivals = [Arrival(0.0, big, tenant="big"), Arrival(3.0, small, tenant="small")]
    store, _ = simulate(params, arrivals, ClaimTimes)
    big_id, small_id = sorted(store.batches)
    waited = store.first_claim[small_id] - store.batches[small_id].arrives_at
    assert waited <= Settings().flush_seconds, waited
    # It runs in the first free slots, well before the big batch's first half.
    ends = completion(store, [small_id, big_id])
    assert ends[small_id] < 0.1 * ends[big_id], ends
    assert len(store.finished) == len(big) + len(small)


class FlakyWaiting(ClaimTimes):
    """``ClaimTimes`` whose look at the waiting batches fails as a database outage would, the
    first ``failures`` times once the small batch has arrived."""

    def __init__(self, clock: VirtualClock, arrivals: list[Arrival], failures: int = 3) -> None:
        super().__init__(clock, arrivals)
        self.failures = failures

    def waiting(self, model: str) -> list[WaitingBatch]:
        found = super().waiting(model)
        if len(self.batches) > 1 and self.failures:
            self.failures -= 1
            raise OperationalError("SELECT", {}, Exception("server closed the connection"))
        return found


def test_a_failed_look_for_new_batches_loses_nothing_and_runs_nothing_twice() -> None:
    big = [([1, i % 250 + 1, 7], 200 + (i * 37) % 800) for i in range(600)]
    small = [([2, i + 1, 7], 4) for i in range(5)]
    arrivals = [Arrival(0.0, big, tenant="big"), Arrival(3.0, small, tenant="small")]
    store, _ = simulate(Params(max_num_seqs=64), arrivals, FlakyWaiting)
    assert store.failures == 0, "the look never failed"
    # Every line finished exactly once, and the small batch was still taken early.
    finished = Counter(batch_id for batch_id, _, _ in store.finished)
    assert sorted(finished.values()) == [len(small), len(big)]
    assert all(row.status == "succeeded" for row in store.rows.values())
    big_id, small_id = sorted(store.batches)
    assert store.first_claim[small_id] - store.batches[small_id].arrives_at <= 5.0


class SkipsTheNewBatchOnce(ClaimTimes):
    """``ClaimTimes`` whose first claim after the small batch arrives takes none of its lines
    while the batch is among the waiting ones, as a claim does on PostgreSQL when another
    transaction still holds those rows (``FOR UPDATE SKIP LOCKED``)."""

    skipped = False

    def claim(self, *args: Any, **kwargs: Any) -> list[ClaimedRequest]:
        return self._skip(super().claim(*args, **kwargs))

    def claim_shared(self, *args: Any, **kwargs: Any) -> SharedClaim:
        claimed = super().claim_shared(*args, **kwargs)
        return SharedClaim(self._skip(claimed.rows), claimed.waiting)

    def _skip(self, rows: list[ClaimedRequest]) -> list[ClaimedRequest]:
        small = {b.id for b in self.batches.values() if b.tenant == "small"}
        if not small or self.skipped:
            return rows
        self.skipped = True
        back = [row for row in rows if row.batch_id in small]
        for row in reversed(back):
            self.rows[row.id].status = LineStatus.PENDING
            self.rows[row.id].attempts -= 1
            self.batches[row.batch_id].pending.appendleft(row.id)
            self.first_claim.pop(row.batch_id, None)
        return [row for row in rows if row not in back]


def test_a_batch_a_claim_saw_but_took_nothing_of_is_still_taken_within_one_claim_cycle() -> None:
    big = [([1, i % 250 + 1, 7], 200 + (i * 37) % 800) for i in range(1500)]
    small = [([2, i + 1, 7], 4) for i in range(5)]
    arrivals = [Arrival(0.0, big, tenant="big"), Arrival(3.0, small, tenant="small")]
    store, _ = simulate(Params(max_num_seqs=64), arrivals, SkipsTheNewBatchOnce)
    assert store.skipped, "no claim came after the small batch arrived"
    big_id, small_id = sorted(store.batches)
    waited = store.first_claim[small_id] - store.batches[small_id].arrives_at
    assert waited <= 2 * Settings().flush_seconds, waited
    assert len(store.finished) == len(big) + len(small)
