"""The fair share's arithmetic (water filling over virtual time, tenants joining and leaving), the
held queue's place for a starting batch, and ``offpeak bench tenants`` at a tiny size on the
simulation's engine and store."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from offpeak.cli import app
from storage.repositories.requests import ClaimedRequest
from storage.repositories.shared_claims import SharedClaim, WaitingBatch
from workers.engine.base import EngineRequest, SamplingSpec
from workers.engine_io import Prepared
from workers.runner.held import HeldLine, HeldLines
from workers.scheduler.fair_share import Claimant, FairShare, water_fill


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
    assert fair["jain"] > edf["jain"]


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
    # Once held, a batch's next lines queue behind the others'.
    held.queue([held_line(7, "b"), held_line(8, "a")])
    assert [h.row.id for h in held.queued][-2:] == [7, 8]
