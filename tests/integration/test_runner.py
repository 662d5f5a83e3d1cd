"""The runner, finalization, cancel, expiry and leases, on real PostgreSQL with engines that
stand in for vLLM (the tests are about scheduling and bookkeeping, not the model)."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any
from unittest.mock import ANY

import pytest
from openai import OpenAI
from sqlalchemy import func, select, update

from offpeak.settings import ModelConfig, Settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.models import EngineChunk, EngineChunkBatch, File, RequestLine
from storage.repositories import requests as requests_repo
from storage.repositories.requests import ClaimedRequest, FinishedLine
from storage.repositories.shared_claims import SharedClaim
from tests.support.batches import check_billed_once, check_ran_batch, line, tenant_client, validate
from tests.support.engines import SlowEngine
from workers.engine.base import EngineRequest
from workers.engine.instant import InstantEngine
from workers.finalize import finalize
from workers.runner import Runner
from workers.runner.gc_tuning import YOUNG_THRESHOLD, tune_collector
from workers.scheduler.store import DbStore

MODEL = "runner-model"


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"models": {MODEL: ModelConfig(engine="instant")}, "flush_seconds": 0.05}
    )


@pytest.fixture()
def tenant_sdk(settings: Settings) -> tuple[str, OpenAI]:
    return tenant_client(settings)


def make(settings: Settings, tenant: str, lines: list[bytes]) -> str:
    batch, _ = validate(settings, b"\n".join(lines), tenant_name=tenant)
    assert batch.status == "in_progress", batch.errors
    return batch.id


def runner(settings: Settings, engine: InstantEngine, owner: str = "w1") -> Runner:
    return Runner(settings, engine, owner, lambda _b: None)


def test_drain_finalize_and_files(settings: Settings, tenant_sdk: tuple[str, OpenAI]) -> None:
    tenant, sdk = tenant_sdk
    lines = [line(f"r{i}", model=MODEL) for i in range(9)]
    lines.append(line("hot", model=MODEL, body_temperature=5))
    batch_id = make(settings, tenant, lines)
    stats = runner(settings, InstantEngine(MODEL)).drain()
    assert stats.requests == 9
    assert finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id).done
    batch = sdk.batches.retrieve(batch_id)
    assert batch.status == "completed" and batch.finalizing_at and batch.completed_at
    output, errors = check_ran_batch(sdk, batch, [f"r{i}" for i in range(9)] + ["hot"])
    assert len(output) == 9
    assert errors[0]["custom_id"] == "hot" and errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["param"] == "temperature"
    with session_scope(settings.resolved_database_url) as session:
        shares = session.scalars(
            select(EngineChunkBatch).where(EngineChunkBatch.batch_id == batch_id)
        ).all()
        chunks = session.scalars(
            select(EngineChunk).where(EngineChunk.id.in_([s.chunk_id for s in shares]))
        ).all()
    assert sum(s.requests for s in shares) == 9  # the 400 line used no engine time
    assert sum(s.prompt_tokens for s in shares) == batch.usage.input_tokens
    assert sum(s.completion_tokens for s in shares) == batch.usage.output_tokens
    assert all(c.busy_seconds >= 0 and c.model == MODEL for c in chunks)


def test_finalize_is_idempotent(settings: Settings, tenant_sdk: tuple[str, OpenAI]) -> None:
    tenant, sdk = tenant_sdk
    batch_id = make(settings, tenant, [line(f"r{i}", model=MODEL) for i in range(5)])
    runner(settings, InstantEngine(MODEL)).drain()
    blobs = get_blob_store(settings.resolved_blob_url)
    finalize(settings, blobs, batch_id)
    first = sdk.batches.retrieve(batch_id)
    for _ in range(3):
        assert finalize(settings, blobs, batch_id).done
    again = sdk.batches.retrieve(batch_id)
    assert again.model_dump() == first.model_dump()
    with session_scope(settings.resolved_database_url) as session:
        outputs = session.scalar(select(func.count()).where(File.filename.like(f"{batch_id}_%")))
    assert outputs == 1


def test_finalize_resumes_after_a_crash_while_finalizing(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    tenant, sdk = tenant_sdk
    batch_id = make(settings, tenant, [line(f"r{i}", model=MODEL) for i in range(3)])
    runner(settings, InstantEngine(MODEL)).drain()
    with session_scope(settings.resolved_database_url) as session:
        from storage.repositories import batches as batches_repo

        row = batches_repo.get_any(session, batch_id)
        assert row is not None
        row.status = "finalizing"  # the first step committed, then the worker died
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    batch = sdk.batches.retrieve(batch_id)
    assert batch.status == "completed"
    check_ran_batch(sdk, batch, ["r0", "r1", "r2"])


def test_cancel_mid_chunk(settings: Settings, tenant_sdk: tuple[str, OpenAI]) -> None:
    tenant, sdk = tenant_sdk
    ids = [f"r{i}" for i in range(200)]
    batch_id = make(settings, tenant, [line(i, model=MODEL) for i in ids])
    worker = threading.Thread(target=runner(settings, SlowEngine(MODEL)).drain)
    worker.start()
    deadline = time.monotonic() + 30
    while sdk.batches.retrieve(batch_id).request_counts.completed < 10:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert sdk.batches.cancel(batch_id).status == "cancelling"
    worker.join(timeout=30)
    assert not worker.is_alive(), "the runner did not stop the cancelled batch's lines"
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    batch = sdk.batches.retrieve(batch_id)
    assert batch.status == "cancelled" and batch.cancelled_at
    output, errors = check_ran_batch(sdk, batch, ids)
    assert 10 <= len(output) < 200
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


class CancelDuringClaim(DbStore):
    """Returns its second claim only after ``cancel()`` and once ``stopped()`` is true: a claim
    in flight while the batch is cancelled and the runner stops the lines it holds."""

    def __init__(self, url: str, cancel: Any, stopped: Any) -> None:
        super().__init__(url)
        self.cancel, self.stopped = cancel, stopped
        self.claimed: list[set[int]] = []

    def claim_shared(self, *args: Any) -> SharedClaim:
        claimed = super().claim_shared(*args)
        self.claimed.append({row.id for row in claimed.rows})
        if len(self.claimed) == 2:
            self.cancel()
            deadline = time.monotonic() + 30
            while not self.stopped():
                assert time.monotonic() < deadline, "the runner never stopped the batch"
                time.sleep(0.01)
        return claimed


class CountingEngine(SlowEngine):
    def __init__(self, model_name: str, delay: float) -> None:
        super().__init__(model_name, delay)
        self.added = 0

    def add(self, request: EngineRequest) -> None:
        self.added += 1
        super().add(request)


def test_a_claim_in_flight_when_its_batch_is_cancelled_runs_none_of_its_lines(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    tenant, sdk = tenant_sdk
    settings = settings.model_copy(update={"chunk_size": 20})
    ids = [f"r{i}" for i in range(200)]
    batch_id = make(settings, tenant, [line(i, model=MODEL) for i in ids])
    # A line a step: the cancel lands while most of the first claim's lines are still held.
    engine = CountingEngine(MODEL, delay=0.1)
    store = CancelDuringClaim(
        settings.resolved_database_url,
        lambda: sdk.batches.cancel(batch_id),
        lambda: not work.held.row_ids(),
    )
    work = Runner(settings, engine, "w1", lambda _b: None, store=store)
    work.drain()
    first, second = store.claimed[:2]
    assert second and engine.added <= len(first), "a line of the late claim reached the engine"
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    batch = sdk.batches.retrieve(batch_id)
    assert batch.status == "cancelled"
    output, _ = check_ran_batch(sdk, batch, ids)
    assert len(output) < len(first), "the first claim's lines all ran before the cancel"
    check_billed_once(settings.resolved_database_url, batch)
    with session_scope(settings.resolved_database_url) as session:
        late = session.scalars(select(RequestLine.status).where(RequestLine.id.in_(second)))
        assert set(late) == {"cancelled"}


def test_expiry_keeps_finished_lines(settings: Settings, tenant_sdk: tuple[str, OpenAI]) -> None:
    tenant, sdk = tenant_sdk
    ids = [f"r{i}" for i in range(100)]
    batch_id = make(settings, tenant, [line(i, model=MODEL) for i in ids])
    worker = threading.Thread(target=runner(settings, SlowEngine(MODEL)).drain)
    worker.start()
    while sdk.batches.retrieve(batch_id).request_counts.completed < 5:
        time.sleep(0.02)
    with session_scope(settings.resolved_database_url) as session:
        from storage.repositories import batches as batches_repo

        row = batches_repo.get_any(session, batch_id)
        assert row is not None
        row.expires_at = int(time.time()) - 1  # the window ran out
    worker.join(timeout=30)
    assert not worker.is_alive()
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    batch = sdk.batches.retrieve(batch_id)
    assert batch.status == "expired" and batch.expired_at
    output, errors = check_ran_batch(sdk, batch, ids)
    assert len(output) >= 5 and errors
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}


def test_a_batch_finished_before_its_deadline_completes_when_finalized_after_it(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    """Every line answered in time, the finalize late (the control worker was down at the
    deadline): the batch is ``completed``, not ``expired``."""
    from storage.repositories import batches as batches_repo

    tenant, sdk = tenant_sdk
    ids = [f"r{i}" for i in range(20)]
    batch_id = make(settings, tenant, [line(i, model=MODEL) for i in ids])
    runner(settings, InstantEngine(MODEL)).drain()
    with session_scope(settings.resolved_database_url) as session:
        row = batches_repo.get_any(session, batch_id)
        assert row is not None and row.status == "in_progress"  # not finalized yet
        row.expires_at = int(time.time()) - 1  # the window ran out after the last line
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    batch = sdk.batches.retrieve(batch_id)
    assert batch.status == "completed" and batch.completed_at and not batch.expired_at
    output, errors = check_ran_batch(sdk, batch, ids)
    assert len(output) == 20 and not errors
    check_billed_once(settings.resolved_database_url, batch)


def test_lease_takeover_runs_each_line_once(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    tenant, sdk = tenant_sdk
    ids = [f"r{i}" for i in range(20)]
    batch_id = make(settings, tenant, [line(i, model=MODEL) for i in ids])
    url = settings.resolved_database_url
    with session_scope(url) as session:  # worker A claims, then dies without a heartbeat
        dead = requests_repo.claim(
            session,
            model=MODEL,
            limit=100,
            owner="dead",
            lease_until=time.time() - 1,
            at=time.time(),
        )
    assert len(dead) == 20
    runner(settings, InstantEngine(MODEL), owner="alive").drain()  # B takes over
    # A wakes up and tries to write its (stale) results: nothing may change.
    with session_scope(url) as session:
        requests_repo.write_results(
            session,
            "dead",
            [FinishedLine(r.id, r.batch_id, "failed", time.time(), 500, "{}") for r in dead],
        )
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    batch = sdk.batches.retrieve(batch_id)
    output, _ = check_ran_batch(sdk, batch, ids)
    assert len(output) == 20
    with session_scope(url) as session:
        attempts = session.scalars(
            select(RequestLine.attempts).where(RequestLine.batch_id == batch_id)
        ).all()
    assert set(attempts) == {2}


def _claim_all(url: str) -> list[ClaimedRequest]:
    """Lease every pending line of ``MODEL`` (at most 10) to owner ``w`` for a minute."""
    with session_scope(url) as session:
        return requests_repo.claim(
            session, model=MODEL, limit=10, owner="w", lease_until=time.time() + 60, at=time.time()
        )


def test_a_write_back_the_database_refuses_is_raised_and_changes_nothing(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    """The write-back's results go in one pipeline with the transaction's start: a result the
    database refuses (a NUL character) still raises the driver's ``DataError``, a statement's
    fault rather than an outage, nothing of that write is stored, and the pooled connection
    serves the next write, which stores every line once."""
    import psycopg

    from offpeak.endpoints.errors import LineError
    from storage.errors import is_transient
    from storage.models import Batch
    from workers.runner import results

    tenant, sdk = tenant_sdk
    ids = [f"r{i}" for i in range(5)]
    batch_id = make(settings, tenant, [line(i, model=MODEL) for i in ids])
    url = settings.resolved_database_url
    held = _claim_all(url)
    assert len(held) == 5
    refused = [FinishedLine(r.id, r.batch_id, "failed", time.time(), 400, "x\x00y") for r in held]
    with pytest.raises(psycopg.DataError) as caught, session_scope(url) as session:
        requests_repo.write_results(session, "w", refused)
    assert not is_transient(caught.value)
    with session_scope(url) as session:
        statuses = session.scalars(
            select(RequestLine.status).where(RequestLine.batch_id == batch_id)
        ).all()
        batch = session.get(Batch, batch_id)
        assert batch is not None and (batch.completed, batch.failed) == (0, 0)
    assert sorted(statuses) == ["running"] * 5
    with session_scope(url) as session:
        error = LineError("refused by the test", code="test_refusal")
        written = requests_repo.write_results(
            session, "w", [results.failed(r, error, time.time()) for r in held]
        )
    assert written == {r.id for r in held}
    with session_scope(url) as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None and (batch.completed, batch.failed) == (0, 5)
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    _output, errors = check_ran_batch(sdk, sdk.batches.retrieve(batch_id), ids)
    assert sorted(e["custom_id"] for e in errors) == ids


def test_results_travel_as_one_text_split_at_a_control_character_json_never_holds(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    """The write-back sends its results as one text split on the server at U+001E (an empty
    result, U+001F, is NULL): JSON text never holds either unescaped. Results with quotes,
    backslashes, commas, braces and escaped control characters come back byte for byte, a
    never-ran line's stays NULL, and a result that is not JSON text and holds the separator is
    refused before anything is sent."""
    tenant, _sdk = tenant_sdk
    batch_id = make(settings, tenant, [line(f"r{i}", model=MODEL) for i in range(4)])
    url = settings.resolved_database_url
    held = _claim_all(url)
    texts = ['{"a":"x,y"}', '{"b":"q\\"uote\\\\ {}"}', '{"c":"\\u001e\\u001f"}']
    odd = [FinishedLine(held[0].id, batch_id, "failed", time.time(), 400, "x\x1ey")]
    with pytest.raises(ValueError, match="not JSON text"), session_scope(url) as session:
        requests_repo.write_results(session, "w", odd)
    lines = [
        FinishedLine(r.id, batch_id, "failed", time.time(), 400, text)
        for r, text in zip(held, texts, strict=False)
    ] + [FinishedLine(held[3].id, batch_id, "cancelled", time.time())]
    with session_scope(url) as session:
        assert requests_repo.write_results(session, "w", lines) == {r.id for r in held}
    with session_scope(url) as session:
        stored = dict(
            session.execute(
                select(RequestLine.id, RequestLine.result).where(RequestLine.batch_id == batch_id)
            ).all()
        )
    assert [stored[r.id] for r in held] == [*texts, None]


def test_finished_rows_stream_in_line_order_and_a_stream_left_early_frees_its_connection(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    """``iter_finished`` (finalize's read; on PostgreSQL a named cursor): every row in line
    order with its result as stored (tabs, newlines, backslashes; NULL for a line that never
    ran). Finalize can stop reading midway (a render that raises): the cursor is closed and the
    same transaction goes on and commits."""
    tenant, _sdk = tenant_sdk
    batch_id = make(settings, tenant, [line(f"r{i}", model=MODEL) for i in range(5)])
    url = settings.resolved_database_url
    held = _claim_all(url)
    texts = ['{"a":"\\t\\n"}', '{"b":"\\\\"}', "{}", '{"c":" tab\tand\nline"}']
    by_line = sorted(held, key=lambda r: r.custom_id)
    lines = [
        FinishedLine(r.id, batch_id, "failed", time.time(), 400, text)
        for r, text in zip(by_line, texts, strict=False)
    ] + [FinishedLine(by_line[4].id, batch_id, "cancelled", time.time())]
    with session_scope(url) as session:
        requests_repo.write_results(session, "w", lines)
    with session_scope(url) as session:
        rows = list(requests_repo.iter_finished(session, batch_id))
    assert rows == [
        *[(f"r{i}", "failed", text) for i, text in enumerate(texts)],
        ("r4", "cancelled", None),
    ]
    with session_scope(url) as session:
        stream = requests_repo.iter_finished(session, batch_id)
        assert next(stream)[0] == "r0"
        stream.close()  # left after one row
        first = (RequestLine.batch_id == batch_id) & (RequestLine.custom_id == "r0")
        session.execute(update(RequestLine).where(first).values(line=99))
    with session_scope(url) as session:
        assert [r[0] for r in requests_repo.iter_finished(session, batch_id)][-1] == "r0"


@pytest.mark.parametrize("path", ["pipeline", "stepwise"])
def test_a_write_back_stores_only_held_lines_bills_answered_ones_and_reports_lost_leases(
    settings: Settings, tenant_sdk: tuple[str, OpenAI], path: str
) -> None:
    """``write_back.store`` on PostgreSQL (one pipeline: the results, counters and engine chunk
    in one statement) and one statement at a time (SQLite's path, run here on the same
    database) store the same: only the lines the worker still holds, each batch's counters by
    the lines written, an engine chunk of the answered lines written (none when none was),
    the held leases renewed, the lost ones reported, the heartbeat and the statuses."""
    from storage.models import Batch, WorkerRecord
    from storage.repositories import workers as workers_repo
    from storage.repositories import write_back
    from storage.repositories.engine_chunks import EnginePeriod
    from storage.repositories.requests import TokenCounts

    store = write_back.store if path == "pipeline" else write_back._store_stepwise
    owner = f"w-{path}"
    tenant, _ = tenant_sdk
    a = make(settings, tenant, [line(f"a{i}", model=MODEL) for i in range(4)])
    b = make(settings, tenant, [line(f"b{i}", model=MODEL) for i in range(2)])
    url = settings.resolved_database_url
    now = time.time()
    with session_scope(url) as session:
        workers_repo.register(session, owner, "host", [MODEL])
        claimed = requests_repo.claim(
            session, model=MODEL, limit=10, owner=owner, lease_until=now + 60, at=now,
            batch_ids=[a, b],
        )  # fmt: skip
        rows = {r.custom_id: r for r in claimed}
        assert len(rows) == 6
        # Another worker took a3 over (its lease ran out while the owner was away).
        session.execute(
            RequestLine.__table__.update()
            .where(RequestLine.id == rows["a3"].id)
            .values(lease_owner="other")
        )

    def done(custom_id: str, tokens: TokenCounts, status: str = "succeeded") -> FinishedLine:
        row = rows[custom_id]
        code = 200 if status == "succeeded" else 400
        return FinishedLine(row.id, row.batch_id, status, now, code, "{}", tokens)

    results = [
        done("a0", TokenCounts(10, 4, 3)),
        done("a1", TokenCounts(20, 0, 5)),
        done("a2", TokenCounts(6, 0, 0), status="failed"),
        done("a3", TokenCounts(50, 0, 50)),  # not the owner's: neither stored nor billed
        done("b0", TokenCounts(7, 1, 2)),
    ]
    period = EnginePeriod(owner, MODEL, "cpu", now - 2.5, now + 1, 2.5)
    with session_scope(url) as session:
        stored = store(
            session, results, period, lease_until=now + 600,
            held_ids=[rows["b1"].id, rows["a3"].id], batch_ids={a, b},
        )  # fmt: skip
    assert stored.written == {rows[c].id for c in ("a0", "a1", "a2", "b0")}
    assert stored.held == {rows["b1"].id}
    assert stored.statuses == {a: ("in_progress", ANY), b: ("in_progress", ANY)}
    with session_scope(url) as session:
        counters = {
            batch.id: (batch.completed, batch.failed, batch.input_tokens, batch.cached_tokens,
                       batch.output_tokens)
            for batch in session.scalars(select(Batch).where(Batch.id.in_([a, b])))
        }  # fmt: skip
        chunks = session.scalars(select(EngineChunk).where(EngineChunk.worker_id == owner)).all()
        shares = {
            share.batch_id: (share.requests, share.prompt_tokens, share.cached_tokens,
                             share.completion_tokens)
            for share in session.scalars(select(EngineChunkBatch))
            if share.batch_id in (a, b)
        }  # fmt: skip
        b1 = session.get(RequestLine, rows["b1"].id)
        worker = session.get(WorkerRecord, owner)
        assert b1 is not None and b1.lease_expires_at == pytest.approx(now + 600, abs=1e-3)
        assert worker is not None and worker.heartbeat_at == pytest.approx(now + 1, abs=1e-3)
    assert counters == {a: (2, 1, 36, 4, 8), b: (1, 0, 7, 1, 2)}
    assert [(c.requests, c.prompt_tokens, c.cached_tokens, c.completion_tokens,
             c.busy_seconds, c.started_at) for c in chunks] == [
        (3, 37, 5, 10, 2.5, pytest.approx(now - 2.5, abs=1e-3))
    ]  # fmt: skip
    assert shares == {a: (2, 30, 4, 8), b: (1, 7, 1, 2)}
    # A write-back of failed lines alone records no engine chunk (they used no engine time).
    with session_scope(url) as session:
        store(
            session, [done("b1", TokenCounts(), status="failed")], period,
            lease_until=now + 600, held_ids=[], batch_ids=set(),
        )  # fmt: skip
    with session_scope(url) as session:
        chunks = session.scalars(select(EngineChunk).where(EngineChunk.worker_id == owner)).all()
        assert len(chunks) == 1
        batch = session.get(Batch, b)
        assert batch is not None and (batch.completed, batch.failed) == (1, 1)


def test_concurrent_claims_are_disjoint(settings: Settings, tenant_sdk: tuple[str, OpenAI]) -> None:
    tenant, _ = tenant_sdk
    make(settings, tenant, [line(f"r{i}", model=MODEL) for i in range(300)])
    url = settings.resolved_database_url
    claimed: dict[str, list[int]] = {}
    barrier = threading.Barrier(3)

    def claim(owner: str) -> None:
        barrier.wait()
        with session_scope(url) as session:
            rows = requests_repo.claim(
                session,
                model=MODEL,
                limit=100,
                owner=owner,
                lease_until=time.time() + 60,
                at=time.time(),
            )
            time.sleep(0.2)  # hold the row locks while the others claim
        claimed[owner] = [r.id for r in rows]

    threads = [threading.Thread(target=claim, args=(f"w{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for ids in claimed.values() for i in ids]
    assert len(every) == len(set(every)) == 300


def test_sweep_finds_batches_whose_finalize_was_lost(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    from storage.repositories import batches as batches_repo

    tenant, _ = tenant_sdk
    batch_id = make(settings, tenant, [line("r0", model=MODEL)])
    with session_scope(settings.resolved_database_url) as session:
        assert batch_id not in batches_repo.finished_but_running(session)  # a line is pending
    runner(settings, InstantEngine(MODEL)).drain()  # ... and its finalize message is lost
    with session_scope(settings.resolved_database_url) as session:
        assert batch_id in batches_repo.finished_but_running(session)
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    with session_scope(settings.resolved_database_url) as session:
        assert batch_id not in batches_repo.finished_but_running(session)


def test_a_line_that_breaks_preparation_fails_alone(
    settings: Settings, tenant_sdk: tuple[str, OpenAI], monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers import engine_io

    tenant, sdk = tenant_sdk
    batch_id = make(settings, tenant, [line(f"r{i}", model=MODEL) for i in range(5)])
    real, calls = engine_io.prepare, []

    def flaky(request_id: str, endpoint: str, body: dict, engine: object, *a, **k):  # type: ignore[no-untyped-def]
        calls.append(request_id)
        if len(calls) == 1:  # the first line of the chunk hits a bug
            raise RuntimeError("a bug in preparation")
        return real(request_id, endpoint, body, engine, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_io, "prepare", flaky)
    runner(settings, InstantEngine(MODEL)).drain()
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    batch = sdk.batches.retrieve(batch_id)
    output, errors = check_ran_batch(sdk, batch, [f"r{i}" for i in range(5)])
    assert batch.status == "completed" and len(output) == 4
    assert errors[0]["response"]["status_code"] == 500
    assert errors[0]["response"]["body"]["error"]["code"] == "internal_error"


def test_at_the_engine_worker_s_threshold_a_drain_s_lines_outlive_few_collections(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    """A line's objects live from its claim to its write-back: at CPython's default young
    threshold (700) they outlive young collections and pile up in the oldest generation, whose
    full collections traverse the whole heap. At the engine worker's (``tune_collector``) their
    reference counts free them first."""
    tenant, _ = tenant_sdk
    make(settings, tenant, [line(f"r{i}", model=MODEL) for i in range(3000)])
    collections = [0, 0, 0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections[info["generation"]] += 1

    before = gc.get_threshold()
    gc.collect()
    gc.callbacks.append(count)
    try:
        gc.set_threshold(700, *before[1:])
        tune_collector()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
        stats = runner(settings, InstantEngine(MODEL)).drain()
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*before)
    assert stats.requests == 3000
    assert collections[2] == 0 and collections[0] <= 10, collections
