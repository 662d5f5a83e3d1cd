"""Tenants sharing one engine: the real runner and its fair share on the simulation's engine and
store (``workers/sim``: a decode step costs 10 ms + 0.1 ms per running sequence on a virtual
clock, a GPU's memory-bound decode, as ``bench.overhead``'s fake), several tenants with big
batches arriving over time and one tenant with small ones arriving while they run.

Measured, for the fair share and for earliest deadline first (the claim before it) on the same
arrivals: each small batch's completion time (its validation to its last line) against the same
batch alone on the idle engine; Jain's fairness index of engine share (completion tokens, one per
sequence-step) among the big tenants while all of them are backlogged; deadline misses; and the
claim rate (lines claimed per second of the run) with the time between claims (a claim cycle),
and the claim's own rate on PostgreSQL (``bench.claim_rate``).

Targets: small batches within 2 × their time alone plus one claim cycle; Jain ≥ 0.95; no deadline
missed; the claim rate within 10% of earliest deadline first's.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import claim_rate, harness
from offpeak.settings import ModelConfig, Settings
from storage.repositories.requests import ClaimedRequest
from storage.repositories.shared_claims import SharedClaim, Shares, WaitingBatch
from workers.planner import StepModel
from workers.scheduler.clock import VirtualClock
from workers.scheduler.store import WriteBack, WriteBackReport
from workers.sim.day import DAY_START
from workers.sim.engine import MODEL, SimEngine
from workers.sim.store import Arrival, MemoryStore

TARGET_SMALL_FACTOR = 2.0
TARGET_JAIN = 0.95
TARGET_CLAIM_RATE_RATIO = 0.9
WINDOW = "24h"


@dataclass(frozen=True)
class Params:
    """The arrivals: ``big_tenants`` tenants with a ``big_lines`` batch each, ``big_every``
    seconds apart from 0; a small tenant's ``small_lines`` batches every ``small_every`` seconds
    from ``small_from``, ``small_batches`` of them; every line ``reply_tokens`` long."""

    big_tenants: int = 3
    big_lines: int = 3000
    big_every: float = 10.0
    small_batches: int = 4
    small_lines: int = 5
    small_from: float = 30.0
    small_every: float = 20.0
    reply_tokens: int = 32
    max_num_seqs: int = 64
    base_ms: float = 10.0
    per_seq_ms: float = 0.1

    def arrivals(self) -> list[Arrival]:
        def lines(count: int, salt: int) -> list[tuple[list[int], int]]:
            return [([salt % 250 + 1, i % 250 + 1, 7, 8], self.reply_tokens) for i in range(count)]

        bigs = [
            Arrival(n * self.big_every, lines(self.big_lines, n), tenant=f"big-{n + 1}")
            for n in range(self.big_tenants)
        ]
        smalls = [
            Arrival(self.small_from + n * self.small_every, lines(self.small_lines, 100 + n),
                    tenant="small")
            for n in range(self.small_batches)
        ]  # fmt: skip
        return bigs + smalls


class RecordingStore(MemoryStore):
    """The simulation's store, recording every line's finish (virtual seconds and tokens), the
    claims (virtual time, lines) and when each batch was validated (its arrival)."""

    def __init__(self, clock: VirtualClock, arrivals: list[Arrival]) -> None:
        super().__init__(clock, arrivals, WINDOW, DAY_START)
        self.finished: list[tuple[str, float, int]] = []
        self.claim_log: list[tuple[float, int]] = []

    def claim_shared(
        self, model: str, limit: int, owner: str, at: float, lease_until: float, shares: Shares
    ) -> SharedClaim:
        claimed = super().claim_shared(model, limit, owner, at, lease_until, shares)
        self.claim_log.append((at, len(claimed.rows)))
        return claimed

    def write_back(self, write: WriteBack) -> WriteBackReport:
        for result in write.results:
            batch_id = self.rows[result.id].batch_id
            self.finished.append((batch_id, result.finished_at, result.tokens.completion))
        return super().write_back(write)


class EdfStore(RecordingStore):
    """The claim before the fair share: earliest deadline first, whatever the shares."""

    def claim_shared(
        self, model: str, limit: int, owner: str, at: float, lease_until: float, shares: Shares
    ) -> SharedClaim:
        rows: list[ClaimedRequest] = self.claim(model, limit, owner, at, lease_until)
        self.claim_log.append((at, len(rows)))
        return SharedClaim(rows, super().waiting(model))

    def waiting(self, model: str) -> list[WaitingBatch]:
        # Before the fair share a full queue never looked for new batches.
        return []


def simulate(params: Params, arrivals: list[Arrival], store_type: type[RecordingStore]) -> Any:
    """Run ``arrivals`` through the real runner on the simulation's engine and ``store_type``;
    the store, with what it recorded, and the wall seconds the run took."""
    from workers.runner import Runner  # the runner imports the engine stack lazily too

    clock = VirtualClock(DAY_START)
    engine = SimEngine(clock, StepModel(params.base_ms, params.per_seq_ms), params.max_num_seqs)
    store = store_type(clock, arrivals)
    settings = Settings(
        models={MODEL: ModelConfig(engine="instant", max_num_seqs=params.max_num_seqs)},
        allowed_completion_windows=[WINDOW],
    )
    runner = Runner(
        settings,
        engine,  # type: ignore[arg-type]  # SimEngine implements the Engine protocol
        "bench-tenants",
        device="simulated",
        store=store,
        clock=clock,
        step_model=StepModel(params.base_ms, params.per_seq_ms),
        export_metrics=False,
    )
    quiet = logging.getLogger("workers")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    started = time.perf_counter()
    try:
        runner.run(until=lambda: store.all_done() or clock.time() >= DAY_START + 86_400)
    finally:
        quiet.setLevel(level)
    return store, time.perf_counter() - started


def completion(store: RecordingStore, batch_ids: Collection[str]) -> dict[str, float]:
    """Seconds from each batch's arrival to its last line's finish."""
    last: dict[str, float] = defaultdict(float)
    for batch_id, at, _ in store.finished:
        last[batch_id] = max(last[batch_id], at)
    return {b: last[b] - store.batches[b].arrives_at for b in batch_ids}


def jain(values: Collection[float]) -> float:
    """Jain's fairness index, (Σx)² / (n Σx²): 1 when all are equal, 1/n when one has all
    (Jain, Chiu and Hawe, DEC-TR-301, 1984)."""
    squares = sum(x * x for x in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else 1.0


def measure(params: Params, store_type: type[RecordingStore]) -> dict[str, Any]:
    """One policy on the params' arrivals: per small batch its completion seconds (and alone),
    Jain's index among the big tenants while all are backlogged, misses, claim figures."""
    store, wall = simulate(params, params.arrivals(), store_type)
    batches = list(store.batches.values())
    tenant_of = {b.id: b.tenant for b in batches}
    bigs = [b for b in batches if b.tenant != "small"]
    smalls = [b for b in batches if b.tenant == "small"]
    ends = completion(store, [b.id for b in batches])
    # All big tenants backlogged: from the last one's arrival to the first one's end.
    since = max(b.arrives_at for b in bigs)
    until = min(b.arrives_at + ends[b.id] for b in bigs)
    served: dict[str, float] = {b.tenant: 0.0 for b in bigs}
    for batch_id, at, tokens in store.finished:
        if since <= at <= until and tenant_of[batch_id] in served:
            served[tenant_of[batch_id]] += tokens
    claims = [(at, n) for at, n in store.claim_log if n]
    gaps = [b[0] - a[0] for a, b in zip(claims, claims[1:], strict=False)]
    run_seconds = max(at for _, at, _ in store.finished) - DAY_START
    return {
        "small_seconds": [ends[b.id] for b in smalls],
        "big_seconds": [ends[b.id] for b in bigs],
        "backlogged_seconds": until - since,
        "engine_share": {t: served[t] / (sum(served.values()) or 1) for t in sorted(served)},
        "jain": jain(list(served.values())),
        "deadline_misses": sum(1 for b in batches if b.arrives_at + ends[b.id] > b.expires_at),
        "lines": len(store.finished),
        "claims": len(claims),
        "claim_cycle_s": sum(gaps) / len(gaps) if gaps else 0.0,
        "claim_rate_lines_per_s": sum(n for _, n in claims) / run_seconds,
        "run_seconds": run_seconds,
        "wall_seconds": wall,
    }


def alone_seconds(params: Params) -> float:
    """A small batch's completion seconds on the idle engine."""
    arrival = Arrival(0.0, params.arrivals()[-1].lines, tenant="small")
    store, _ = simulate(params, [arrival], RecordingStore)
    return max(completion(store, list(store.batches)).values())


def run(
    params: Params | None = None, out_dir: Path | None = None, claim_lines: int = 30_000
) -> dict[str, Any]:
    """Both policies on the same arrivals and the small batch alone, then the claim's own rate
    on PostgreSQL over ``claim_lines`` lines (``bench.claim_rate``; 0: not measured); print the
    tables, write ``tenants.json``."""
    params = params or Params()
    alone = alone_seconds(params)
    fair, edf = measure(params, RecordingStore), measure(params, EdfStore)
    bound = TARGET_SMALL_FACTOR * alone + fair["claim_cycle_s"]
    sql = claim_rate.measure(claim_lines, params.big_tenants) if claim_lines else None
    ratio = sql["ratio"] if sql else fair["claim_rate_lines_per_s"] / edf["claim_rate_lines_per_s"]
    result = {
        "benchmark": "tenants",
        "machine": harness.machine(),
        "params": params.__dict__,
        "small_alone_s": alone,
        "fair": fair,
        "edf": edf,
        "targets": {
            "small_s": bound,
            "jain": TARGET_JAIN,
            "deadline_misses": 0,
            "claim_rate_ratio": TARGET_CLAIM_RATE_RATIO,
        },
        "met": {
            "small_s": max(fair["small_seconds"]) <= bound,
            "jain": fair["jain"] >= TARGET_JAIN,
            "deadline_misses": fair["deadline_misses"] == 0,
            "claim_rate_ratio": ratio >= TARGET_CLAIM_RATE_RATIO,
        },
        "claim_sql": sql,
    }
    rows = [
        [name, max(r["small_seconds"]), r["jain"], r["deadline_misses"],
         r["claim_rate_lines_per_s"], r["claim_cycle_s"], r["run_seconds"]]
        for name, r in (("fair share", fair), ("earliest deadline first", edf))
    ]  # fmt: skip
    harness.print_table(
        f"tenants: {params.big_tenants} × {params.big_lines:,} lines and {params.small_batches} "
        f"small batches of {params.small_lines} (alone: {alone:.2f} s; target ≤ {bound:.2f} s)",
        ["claim", "slowest small s", "Jain", "misses", "lines claimed/s", "claim cycle s",
         "run s"],
        rows,
    )  # fmt: skip
    if sql:
        harness.print_table(
            f"the claim on PostgreSQL: {sql['lines']:,} lines of {sql['tenants']} tenants in "
            f"claims of {sql['chunk']} (fair / EDF = {sql['ratio']:.2f})",
            ["claim", "lines/s (median)", "rounds"],
            [[name, sql[f"{leg}_lines_per_s"], str([round(r) for r in sql["rounds"][leg]])]
             for name, leg in (("fair share", "fair"), ("earliest deadline first", "edf"))],
        )  # fmt: skip
    path = harness.write_result("tenants", result, out_dir)
    harness.console.print(f"wrote {path}")
    return result
