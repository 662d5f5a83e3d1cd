"""Accounting on real PostgreSQL: attribution of engine chunks to batches, the ledger (exactly
one bill per batch, whatever repeats), billing of expired and cancelled batches, and the usage
endpoint and table against the batches themselves."""

from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from openai.types import Batch, BatchRequestCounts, BatchUsage
from rich.console import Console
from sqlalchemy import delete, select

from offpeak.billing import TokenWeights
from offpeak.cli import client as client_tools
from offpeak.cli import watching
from offpeak.settings import ModelConfig, ModelPricing, Settings
from storage.db import session_scope
from storage.models import EngineChunk, EngineChunkBatch, LedgerEntry
from storage.repositories import billing as billing_repo
from storage.repositories import engine_chunks
from storage.repositories.engine_chunks import BatchTokens
from tests.support import billing as helpers
from tests.support.batches import validate
from tests.support.billing import AcctTenant as Tenant
from tests.support.billing import end
from tests.support.engines import SlowEngine
from workers import billing
from workers.engine.instant import InstantEngine

#: MANUAL is never drained: its batches only get the chunks a test records by hand.
MODEL, OTHER, MANUAL = "acct-model", "acct-other", "acct-manual"
#: $3.60 per engine-hour = $0.001 per second, so cost = GPU-seconds / 1000.
PER_SECOND = 0.001


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    prices = ModelPricing(input_per_million=1.0, cached_input_per_million=0.5, output_per_million=4)
    return settings.model_copy(
        update={
            "models": {m: ModelConfig(engine="instant") for m in (MODEL, OTHER, MANUAL)},
            "pricing": {MODEL: prices, OTHER: ModelPricing(output_per_million=2.0)},
            "gpu_cost_per_hour": {"cpu": PER_SECOND * 3600},
            "flush_seconds": 0.05,
        }
    )


@pytest.fixture()
def tenant(settings: Settings) -> Tenant:
    return Tenant(settings)


def make(settings: Settings, tenant: Tenant, n: int, model: str = MODEL, prefix: str = "r") -> str:
    return helpers.make(settings, tenant, n, model, prefix)


def run(settings: Settings, model: str = MODEL, engine: InstantEngine | None = None) -> None:
    helpers.run(settings, model, engine)


def parts(batch: Batch) -> tuple[dict[str, Any], BatchRequestCounts, BatchUsage]:
    """A batch's Offpeak extra fields, request counts and usage (all present once it ran)."""
    assert batch.model_extra is not None and batch.request_counts and batch.usage
    return batch.model_extra, batch.request_counts, batch.usage


def ledger_rows(settings: Settings, batch_id: str) -> list[LedgerEntry]:
    with session_scope(settings.resolved_database_url) as session:
        return list(session.scalars(select(LedgerEntry).where(LedgerEntry.batch_id == batch_id)))


def test_attribution_of_a_shared_chunk_follows_the_rule_and_adds_up(
    settings: Settings, tenant: Tenant
) -> None:
    a, b = make(settings, tenant, 1, MANUAL, "a"), make(settings, tenant, 1, MANUAL, "b")
    weights = TokenWeights(prefill=0.25, cached=0.0, decode=1.0)
    with session_scope(settings.resolved_database_url) as session:
        chunk = engine_chunks.record(
            session,
            worker_id="w",
            model=MODEL,
            device="cpu",
            started_at=time.time() - 3,
            ended_at=time.time(),
            busy_seconds=3.0,
            per_batch={
                a: BatchTokens(
                    requests=2, prompt_tokens=100, cached_tokens=40, completion_tokens=30
                ),
                b: BatchTokens(requests=1, prompt_tokens=20, cached_tokens=0, completion_tokens=90),
            },
        )
        shares = billing_repo.chunk_shares(session, chunk, weights)
        idle = engine_chunks.record(
            session,
            worker_id="w",
            model=MODEL,
            device="cpu",
            started_at=time.time() - 1,
            ended_at=time.time(),
            busy_seconds=0.9,
            per_batch={a: BatchTokens(requests=2), b: BatchTokens(requests=1)},
        )
        by_requests = billing_repo.chunk_shares(session, idle, weights)
        per_batch = billing_repo.attributed_seconds(session, [a, b], weights)
    # weight(a) = 0.25 × (100 − 40) + 0 × 40 + 30 = 45; weight(b) = 0.25 × 20 + 90 = 95.
    assert shares[a] == pytest.approx(3.0 * 45 / 140)
    assert shares[b] == pytest.approx(3.0 * 95 / 140)
    assert sum(shares.values()) == pytest.approx(3.0, abs=1e-12)
    # No token weighs anything: split by finished requests.
    assert by_requests == pytest.approx({a: 0.6, b: 0.3})
    assert per_batch[a]["cpu"] + per_batch[b]["cpu"] == pytest.approx(3.9, abs=1e-12)


def test_attribution_of_real_chunks_adds_up_to_their_seconds(
    settings: Settings, tenant: Tenant
) -> None:
    """Two batches drained by one runner share its chunks; every chunk's seconds are split
    between them with nothing lost or made up."""
    a, b = make(settings, tenant, 30, prefix="a"), make(settings, tenant, 30, prefix="b")
    # One write-back for the whole drain, so its chunk holds both batches however slowly the
    # (shared, loaded) machine steps.
    run(settings.model_copy(update={"flush_seconds": 60.0}))
    weights = TokenWeights(settings.prefill_token_weight, settings.cached_token_weight, 1.0)
    with session_scope(settings.resolved_database_url) as session:
        chunk_ids = set(
            session.scalars(
                select(EngineChunkBatch.chunk_id).where(EngineChunkBatch.batch_id.in_([a, b]))
            )
        )
        chunks = session.scalars(select(EngineChunk).where(EngineChunk.id.in_(chunk_ids))).all()
        shares = {c.id: billing_repo.chunk_shares(session, c.id, weights) for c in chunks}
        per_batch = billing_repo.attributed_seconds(session, [a, b], weights)
    assert any({a, b} <= set(s) for s in shares.values()), "no chunk held both batches"
    for chunk in chunks:
        total = sum(shares[chunk.id].values())
        assert total == pytest.approx(chunk.busy_seconds, rel=1e-9, abs=1e-12)
    for batch_id in (a, b):
        from_chunks = sum(s.get(batch_id, 0.0) for s in shares.values())
        assert per_batch[batch_id]["cpu"] == pytest.approx(from_chunks, rel=1e-9)
        assert from_chunks > 0


def test_ledger_bills_once_under_polls_refinalize_sweeps_and_races(
    settings: Settings, tenant: Tenant
) -> None:
    batch_id = make(settings, tenant, 12)
    run(settings)
    running, _, _ = parts(tenant.sdk.batches.retrieve(batch_id))
    assert running["billed_at"] is None  # a live estimate until it ends
    assert running["gpu_seconds"] > 0
    end(settings, batch_id)
    for _ in range(5):
        polled = tenant.sdk.batches.retrieve(batch_id)
    for _ in range(3):
        end(settings, batch_id)
    assert billing.bill_batch(settings, batch_id) is False
    billing.bill_unbilled(settings)
    [entry] = ledger_rows(settings, batch_id)
    batch = tenant.sdk.batches.retrieve(batch_id)
    assert batch.model_dump() == polled.model_dump()
    extra, counts, usage = parts(batch)
    assert entry.requests == counts.completed == 12
    assert (entry.input_tokens, entry.output_tokens) == (usage.input_tokens, usage.output_tokens)
    assert extra["billed_at"] == int(entry.billed_at)
    assert extra["gpu_seconds"] == pytest.approx(entry.gpu_seconds, abs=1e-6)
    # The ledger keeps dollars to 1e-10.
    assert extra["cost"] == pytest.approx(entry.gpu_seconds * PER_SECOND, abs=1e-10)
    listed = (usage.input_tokens * 1.0 + usage.output_tokens * 4.0) / 1e6  # nothing cached
    assert extra["realtime_price"] == pytest.approx(listed)
    assert extra["price"] == pytest.approx(listed / 2)  # the default 50% batch discount
    assert extra["saving"] == pytest.approx(listed / 2)
    tokens = usage.input_tokens + usage.output_tokens
    assert extra["cost_per_million_tokens"] == pytest.approx(extra["cost"] / tokens * 1e6, rel=1e-6)

    # Billers racing on an unbilled batch: exactly one inserts.
    with session_scope(settings.resolved_database_url) as session:
        session.execute(delete(LedgerEntry).where(LedgerEntry.batch_id == batch_id))
    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(lambda _: billing.bill_batch(settings, batch_id), range(8)))
    assert won.count(True) == 1
    assert len(ledger_rows(settings, batch_id)) == 1


def test_a_failed_billing_step_is_billed_by_the_sweep(
    settings: Settings, tenant: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch_id = make(settings, tenant, 4)
    run(settings)

    def broken(*_args: Any, **_kwargs: Any) -> bool:
        raise RuntimeError("ledger unavailable")

    monkeypatch.setattr(billing.billing_repo, "insert_once", broken)
    end(settings, batch_id)  # the batch ends all the same
    assert tenant.sdk.batches.retrieve(batch_id).status == "completed"
    assert ledger_rows(settings, batch_id) == []
    monkeypatch.undo()
    assert billing.bill_unbilled(settings) >= 1
    assert len(ledger_rows(settings, batch_id)) == 1
    assert parts(tenant.sdk.batches.retrieve(batch_id))[0]["billed_at"] is not None


def test_validation_failures_are_billed_at_zero(settings: Settings, tenant: Tenant) -> None:
    batch, _ = validate(settings, b"not json", tenant_name=tenant.name)
    assert batch.status == "failed"
    billing.bill_unbilled(settings)
    [entry] = ledger_rows(settings, batch.id)
    assert (entry.requests, entry.gpu_seconds, float(entry.price)) == (0, 0.0, 0.0)


@pytest.mark.parametrize("how", ["cancelled", "expired"])
def test_expired_and_cancelled_batches_bill_finished_lines_only(
    settings: Settings, tenant: Tenant, how: str
) -> None:
    batch_id = make(settings, tenant, 150)
    worker = threading.Thread(target=run, args=(settings, MODEL, SlowEngine(MODEL, delay=0.01)))
    worker.start()
    deadline = time.monotonic() + 30
    while parts(tenant.sdk.batches.retrieve(batch_id))[1].completed < 10:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    if how == "cancelled":
        tenant.sdk.batches.cancel(batch_id)
    else:
        from storage.repositories import batches as batches_repo

        with session_scope(settings.resolved_database_url) as session:
            row = batches_repo.get_any(session, batch_id)
            assert row is not None
            row.expires_at = int(time.time()) - 1
    worker.join(timeout=30)
    assert not worker.is_alive()
    end(settings, batch_id)
    batch = tenant.sdk.batches.retrieve(batch_id)
    assert batch.status == how
    [entry] = ledger_rows(settings, batch_id)
    _, counts, usage = parts(batch)
    assert 10 <= entry.requests == counts.completed < counts.total == 150
    assert entry.output_tokens == usage.output_tokens == 2 * counts.completed
    assert float(entry.price) == pytest.approx(
        (usage.input_tokens + 4 * usage.output_tokens) / 1e6 / 2
    )
    assert entry.status == how


def test_usage_endpoint_matches_the_batches(settings: Settings, tenant: Tenant) -> None:
    ids = [make(settings, tenant, 5), make(settings, tenant, 3), make(settings, tenant, 4, OTHER)]
    run(settings)
    run(settings, OTHER)
    for batch_id in ids:
        end(settings, batch_id)
    batches = [tenant.sdk.batches.retrieve(b) for b in ids]
    by_model = tenant.http.get(
        "/v1/usage", params={"group_by": "model"}, headers=tenant.headers
    ).json()
    rows = {row["model"]: row for row in by_model["data"]}
    assert set(rows) == {MODEL, OTHER}
    for model, row in rows.items():
        mine = [parts(b) for b in batches if b.model == model]
        assert row["batches"] == len(mine)
        assert row["requests"] == sum(counts.completed for _, counts, _ in mine)
        assert row["input_tokens"] == sum(usage.input_tokens for _, _, usage in mine)
        assert row["output_tokens"] == sum(usage.output_tokens for _, _, usage in mine)
        assert row["total_tokens"] == row["input_tokens"] + row["output_tokens"]
        for field in ("gpu_seconds", "cost", "price", "realtime_price", "saving"):
            # Each figure is rounded on its own (GPU-seconds to 1e-6): sums differ by a rounding.
            assert row[field] == pytest.approx(sum(extra[field] for extra, _, _ in mine), abs=1e-5)
    total = by_model["total"]
    assert total["batches"] == 3 and total["requests"] == 12
    assert total["price"] == pytest.approx(sum(parts(b)[0]["price"] for b in batches))

    by_day = tenant.http.get("/v1/usage?group_by=day", headers=tenant.headers).json()
    assert sum(row["batches"] for row in by_day["data"]) == 3  # one day (two across midnight)
    assert by_day["data"][-1]["day"] == time.strftime("%Y-%m-%d", time.gmtime())
    assert by_day["total"] == total

    later = int(time.time()) + 10
    window = {"start": later, "end": later + 60}
    empty = tenant.http.get("/v1/usage", params=window, headers=tenant.headers).json()
    assert empty["data"] == [] and empty["total"]["batches"] == 0

    stranger = Tenant(settings)
    assert stranger.http.get("/v1/usage", headers=stranger.headers).json()["total"]["batches"] == 0
    bad = tenant.http.get("/v1/usage?group_by=week", headers=tenant.headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_by"
    backwards = tenant.http.get("/v1/usage?start=10&end=5", headers=tenant.headers)
    assert backwards.status_code == 400 and backwards.json()["error"]["param"] == "start"
    assert tenant.http.get("/v1/usage").status_code == 401

    # `offpeak usage` prints the same report through the SDK.
    report = client_tools.usage(tenant.sdk, None, None, "model")
    assert report["total"] == total
    out = io.StringIO()
    client_tools.print_usage(report, Console(file=out, width=160))
    table = out.getvalue()
    assert MODEL in table and OTHER in table and "total" in table
    assert client_tools.format_count(total["input_tokens"]) in table


def test_the_cli_summary_shows_cost_and_saving(settings: Settings, tenant: Tenant) -> None:
    batch_id = make(settings, tenant, 3)
    run(settings)
    end(settings, batch_id)
    out = io.StringIO()
    client_tools.print_summary(tenant.sdk.batches.retrieve(batch_id), Console(file=out, width=160))
    text = out.getvalue()
    assert "GPU-seconds" in text and "saving" in text and "(billed)" in text
    assert "real-time" in text


def test_prices_per_model_and_pool(settings: Settings) -> None:
    import offpeak.billing

    custom = settings.model_copy(
        update={
            "pricing": {MODEL: ModelPricing(gpu_cost_per_hour={"H100": 4.0}, batch_discount=0.4)},
            "gpu_cost_per_hour": {"cpu": 0.1, "default": 2.0},
        }
    )
    assert offpeak.billing.gpu_cost_per_hour(custom, MODEL, "H100") == 4.0
    assert offpeak.billing.gpu_cost_per_hour(custom, MODEL, "cpu") == 0.1
    assert offpeak.billing.gpu_cost_per_hour(custom, OTHER, "A100") == 2.0
    bill = offpeak.billing.bill(custom, MODEL, {"H100": 1800.0, "cpu": 36.0}, 1000, 0, 0)
    assert bill.cost == pytest.approx(2.0 + 0.001)
    assert bill.gpu_seconds == pytest.approx(1836.0)
    assert bill.cost_per_million_tokens == pytest.approx(bill.cost / 1000 * 1e6)


def test_submit_wait_ends_with_the_bill(
    settings: Settings, tenant: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`offpeak submit --wait` shows progress, then the billed figures, not the estimate, even
    when the client sees the final status before the bill is written."""
    batch_id = make(settings, tenant, 3)
    run(settings)
    monkeypatch.setattr(billing.billing_repo, "insert_once", lambda *_a, **_k: 1 / 0)
    end(settings, batch_id)
    monkeypatch.undo()
    later = threading.Timer(0.3, billing.bill_batch, args=(settings, batch_id))
    later.start()
    out = io.StringIO()
    batch = watching.wait_with_progress(
        tenant.sdk, batch_id, Console(file=out, width=160), poll=0.1
    )
    later.join()
    assert parts(batch)[0]["billed_at"] is not None
    assert "tok/s" in out.getvalue() and "ETA" in out.getvalue()
