"""The scheduler on real PostgreSQL, with engines that stand in for vLLM (these tests are about
when and how much batch work runs, not about the model) and the load read from a real HTTP
endpoint serving Prometheus text: yield and resume with hysteresis, urgent batches under high
load, hard pause, top-up claims and sizing, prefix ordering, slack on the batch object, expiry,
and a 60-second window kept under high load."""

from __future__ import annotations

import io
import logging
import secrets
import threading
import time
from collections.abc import Iterator

import orjson
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from sqlalchemy import func, select, update

from api.app import create_app
from api.schemas.batches import CreateBatch
from api.services import batches as batches_service
from api.services import files as files_service
from api.services import keys
from offpeak import scheduler_state
from offpeak.settings import ModelConfig, SchedulerSettings, Settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.models import Batch, RequestLine
from storage.repositories import requests as requests_repo
from storage.repositories import scheduler as scheduler_repo
from tests.support.batches import check_ran_batch, line_statuses
from tests.support.database import new_key
from tests.support.scheduler import MetricsEndpoint, decoding_engine, metrics_endpoint
from workers.engine.instant import InstantEngine
from workers.finalize import finalize
from workers.planner import StepModel
from workers.runner import Runner
from workers.scheduler.slack import sweep_estimates
from workers.scheduler.store import DbStore
from workers.sim.engine import SimEngine
from workers.validation import run_validation


@pytest.fixture()
def model() -> str:
    """A model of the test's own: the slack reads the model's engine history, which other
    tests' work must not change."""
    return f"sched-{secrets.token_hex(3)}"


@pytest.fixture()
def endpoint() -> Iterator[MetricsEndpoint]:
    with metrics_endpoint() as e:
        yield e


@pytest.fixture()
def settings(settings: Settings, endpoint: MetricsEndpoint, model: str) -> Settings:
    """Prometheus load from ``endpoint``, read every 0.1 s; a pool of the test's own, so a pause
    elsewhere in the session cannot reach it."""
    policy = SchedulerSettings.model_validate(
        {
            "pool": f"pool-{secrets.token_hex(3)}",
            "load_signals": ["prometheus"],
            "prometheus": {"url": endpoint.url, "timeout_seconds": 1.0},
            "load_poll_seconds": 0.1,
            "estimate_seconds": 0.5,
        }
    )
    return settings.model_copy(
        update={
            "models": {model: ModelConfig(engine="instant", max_num_seqs=16)},
            "flush_seconds": 0.2,
            "scheduler": policy,
        }
    )


def with_policy(settings: Settings, **changes: object) -> Settings:
    policy = settings.scheduler.model_copy(update=changes)
    return settings.model_copy(update={"scheduler": policy})


@pytest.fixture()
def tenant(settings: Settings) -> tuple[str, OpenAI]:
    key = new_key(settings)
    with session_scope(settings.resolved_database_url) as session:
        found = keys.tenant_for_key(session, key)
        assert found is not None
        name = found.name
    client = TestClient(create_app(settings))
    sdk = OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)
    return name, sdk


def chat(
    model: str, custom_id: str, content: str, max_tokens: int, system: str | None = None
) -> bytes:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    body = {"model": model, "messages": messages, "max_tokens": max_tokens}
    return orjson.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def make_batch(settings: Settings, tenant: str, lines: list[bytes], window: str = "24h") -> str:
    """Upload, create (with ``window``) and validate a batch; returns its id (in_progress)."""
    blobs = get_blob_store(settings.resolved_blob_url)
    with session_scope(settings.resolved_database_url) as session:
        owner = keys.ensure_tenant(session, tenant)
        file = files_service.upload(
            session,
            blobs,
            settings,
            tenant_id=owner.id,
            stream=io.BytesIO(b"\n".join(lines)),
            filename="in.jsonl",
            purpose="batch",
            expires_after_seconds=None,
        )
        batch = batches_service.create(
            session,
            settings,
            owner.id,
            CreateBatch(
                input_file_id=file.id, endpoint="/v1/chat/completions", completion_window=window
            ),
        )
        session.info.pop("after_commit", None)  # the test runs the validation itself
    run_validation(settings, blobs, batch.id)
    return batch.id


def end(settings: Settings, sdk: OpenAI, batch_id: str, ids: list[str]):  # type: ignore[no-untyped-def]
    assert finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id).done
    batch = sdk.batches.retrieve(batch_id)
    check_ran_batch(sdk, batch, ids)
    return batch


def test_yields_when_load_rises_and_resumes_only_below_low_water(
    settings: Settings, model: str, tenant: tuple[str, OpenAI], endpoint: MetricsEndpoint
) -> None:
    name, sdk = tenant
    ids = [f"r{i}" for i in range(64)]
    batch_id = make_batch(settings, name, [chat(model, i, "Hi", 60) for i in ids])
    engine = decoding_engine(model, max_num_seqs=8, base_ms=4)
    runner = Runner(settings, engine, "w-yield", clock=engine.clock)
    endpoint.set(kv=0.1)

    def traffic_arrives(at: float, cost: float) -> None:
        """Real-time traffic arrives once the first lines are written back."""
        if endpoint.kv < 0.9 and line_statuses(settings, batch_id).get("succeeded", 0) >= 8:
            endpoint.set(kv=0.9)

    engine.on_step = traffic_arrives
    stats = runner.drain()
    engine.on_step = None
    assert endpoint.kv == 0.9, "the first lines never finished"
    assert stats.outcome == "yielded" and stats.aborted > 0, "the runner did not yield"
    after_yield = line_statuses(settings, batch_id)
    assert "running" not in after_yield, "aborted lines must go back to pending"
    with session_scope(settings.resolved_database_url) as session:
        attempts = session.scalars(
            select(RequestLine.attempts).where(
                RequestLine.batch_id == batch_id, RequestLine.status == "pending"
            )
        ).all()
    assert set(attempts) == {0}, "a yield is not a failed attempt"

    endpoint.set(kv=0.45)  # fallen below high-water, but not to low-water: still yielding
    stats = runner.drain()
    assert stats.outcome == "yielded" and stats.requests == 0
    assert line_statuses(settings, batch_id) == after_yield  # finished lines kept, nothing new ran

    endpoint.set(kv=0.2)
    stats = runner.drain()
    assert stats.outcome == "drained"
    batch = end(settings, sdk, batch_id, ids)
    assert batch.status == "completed" and batch.request_counts.completed == 64


def test_urgent_batch_runs_under_high_load_and_a_hard_pause_stops_it(
    settings: Settings,
    model: str,
    tenant: tuple[str, OpenAI],
    endpoint: MetricsEndpoint,
    caplog: pytest.LogCaptureFixture,
) -> None:
    name, sdk = tenant
    # Margin: half the window. The fallback step model says 0.8 tokens/s, so 10 lines of ~10
    # tokens due in 60 s are urgent at once; the 24 h batch has hours to spare.
    settings = with_policy(settings, urgent_margin_fraction=0.5, expected_completion_tokens=10)
    urgent_ids = [f"u{i}" for i in range(10)]
    urgent = make_batch(settings, name, [chat(model, i, "Hi", 10) for i in urgent_ids], "60s")
    relaxed = make_batch(settings, name, [chat(model, f"r{i}", "Hi", 10) for i in range(10)])
    endpoint.set(waiting=20)  # load 2.0: far above high-water
    store = DbStore(settings.resolved_database_url)
    runner = Runner(
        settings,
        decoding_engine(model, max_num_seqs=8),
        "w-urgent",
        store=store,
        step_model=StepModel(base_ms=10_000, per_seq_ms=0),
    )
    with session_scope(settings.resolved_database_url) as session:
        scheduler_repo.put_state(
            session,
            scheduler_state.pause_key(settings.scheduler.pool),
            {"paused": True, "hard": True, "reason": "test"},
            time.time(),
        )
    stats = runner.drain()
    assert stats.outcome == "yielded" and stats.requests == 0  # hard pause: not even urgent
    assert urgent in runner.urgent_seen and relaxed not in runner.urgent_seen

    with session_scope(settings.resolved_database_url) as session:
        scheduler_repo.delete_state(session, scheduler_state.pause_key(settings.scheduler.pool))
    with caplog.at_level(logging.INFO, logger="workers"):
        stats = runner.drain()
    assert stats.outcome == "yielded"  # load still high: the relaxed batch waits
    assert line_statuses(settings, urgent) == {"succeeded": 10}
    assert line_statuses(settings, relaxed) == {"pending": 10}
    assert f"batch {urgent} is urgent" in caplog.text
    batch = end(settings, sdk, urgent, urgent_ids)
    assert batch.status == "completed"


def test_claims_top_up_while_decoding_and_sizing_follows_the_requests(
    settings: Settings, model: str, tenant: tuple[str, OpenAI], caplog: pytest.LogCaptureFixture
) -> None:
    name, sdk = tenant

    class CountingStore(DbStore):
        held_at_claim: list[int] = []
        limits: list[int] = []

        def claim_shared(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.held_at_claim.append(engine.num_unfinished())
            self.limits.append(args[1])
            return super().claim_shared(*args, **kwargs)

    # A KV cache of 4,096 tokens: short requests fit 16 at once (the engine's max_num_seqs),
    # requests of ~500 tokens only 7.
    engine = decoding_engine(model, max_num_seqs=16, kv_cache_tokens=4096)
    # Which threads prepare (tokenize) claimed lines: top-ups are claimed and prepared on the
    # claim thread while the engine decodes, not between its steps.
    encode, encoded_on = engine.encode_chat, set()

    def encode_chat(messages):  # type: ignore[no-untyped-def]
        encoded_on.add(threading.current_thread().name.split("_")[0])
        return encode(messages)

    engine.encode_chat = encode_chat  # type: ignore[method-assign]
    short_ids = [f"s{i}" for i in range(100)]
    long_ids = [f"l{i}" for i in range(20)]
    short = make_batch(settings, name, [chat(model, i, "Hi", 20) for i in short_ids])
    store = CountingStore(settings.resolved_database_url)
    runner = Runner(settings, engine, "w-sizing", store=store)
    with caplog.at_level(logging.INFO, logger="workers.runner"):
        runner.drain()
        long = make_batch(settings, name, [chat(model, i, "Hi", 500) for i in long_ids])
        runner.drain()
    sizing = [r.getMessage() for r in caplog.records if "sizing:" in r.getMessage()]
    assert any("engine slots 16" in m for m in sizing), sizing
    assert any("engine slots 7" in m for m in sizing), sizing
    assert any(n > 0 for n in store.held_at_claim), "no claim topped up a running engine"
    assert max(store.held_at_claim) <= 2 * 16  # never more than slots x queue_depth held
    assert store.limits[0] == 16  # nothing held: the slots' worth, so the engine starts at once
    assert "claim" in encoded_on, encoded_on
    end(settings, sdk, short, short_ids)
    end(settings, sdk, long, long_ids)


def test_claims_overlap_the_steps_of_an_engine_that_empties_every_step(
    settings: Settings, model: str, tenant: tuple[str, OpenAI]
) -> None:
    """The instant engine finishes every line in the step it was added: at each top-up the
    engine is empty. The next claim is started on the claim thread as soon as lines are admitted,
    so it runs during the step instead of after it with the engine idle; only the first claim
    (nothing held yet) is made on the loop thread, besides the looks for more once the batch
    ran out (nothing held then either). And while the engine empties every step, the runner
    holds up to ``chunk_size`` lines, not ``slots × queue_depth``: a claim per step was the
    pace of such an engine (``ClaimPipeline.limit``)."""
    name, sdk = tenant

    class ThreadStore(DbStore):
        claims: list[tuple[str, int, int]] = []

        def claim_shared(self, model, limit, *args, **kwargs):  # type: ignore[no-untyped-def]
            claimed = super().claim_shared(model, limit, *args, **kwargs)
            thread = threading.current_thread().name.split("_")[0]
            self.claims.append((thread, limit, len(claimed.rows)))
            return claimed

    ids = [f"i{i}" for i in range(300)]
    batch_id = make_batch(settings, name, [chat(model, i, "Hi", 4) for i in ids])
    store = ThreadStore(settings.resolved_database_url)
    settings = settings.model_copy(update={"chunk_size": 128})
    stats = Runner(settings, InstantEngine(model), "w-instant", store=store).drain()
    assert stats.requests == 300
    # 16 slots: the first claim is a slots' worth, made with the engine idle; every later one
    # that found lines overlapped a step, and asked for up to chunk_size (128) minus what was
    # held, not 2 × 16 minus it.
    claims = store.claims
    assert claims[0] == ("MainThread", 16, 16), claims
    taking = [c for c in claims[1:] if c[2]]
    assert len(taking) >= 2 and all(thread == "claim" for thread, _, _ in taking), claims
    assert max(limit for _, limit, _ in taking) > 32, claims
    end(settings, sdk, batch_id, ids)


def test_chunk_runs_prompts_with_a_shared_prefix_together(
    settings: Settings, model: str, tenant: tuple[str, OpenAI], caplog: pytest.LogCaptureFixture
) -> None:
    name, sdk = tenant
    added: list[str] = []

    class Recording(SimEngine):
        def add(self, request):  # type: ignore[no-untyped-def]
            added.append(bytes(request.prompt_token_ids).decode()[:20])
            super().add(request)

    engine = decoding_engine(model, max_num_seqs=64)
    engine.__class__ = Recording
    a = "You are a careful translator from French to English. " * 3
    b = "You are a terse assistant who answers in one word only. " * 3
    # The two system prompts alternate in the file.
    lines = [chat(model, f"q{i}", f"question {i}", 5, a if i % 2 else b) for i in range(30)]
    batch_id = make_batch(settings, name, lines)
    with caplog.at_level(logging.INFO, logger="workers.runner"):
        stats = Runner(settings, engine, "w-prefix").drain()
    switches = sum(1 for x, y in zip(added, added[1:], strict=False) if x != y)
    assert len(added) == 30 and switches == 1, added
    assert stats.cached_tokens > 0 and stats.prefix_hit_rate > 0.5
    assert "prefix-cache hit rate" in caplog.text
    end(settings, sdk, batch_id, [f"q{i}" for i in range(30)])


def test_a_long_shared_prefix_is_prefilled_by_its_first_line_alone(
    settings: Settings, model: str, tenant: tuple[str, OpenAI]
) -> None:
    """The runner holds a document's other questions until its first question has had its
    prefill steps (two for a prompt of 2048-4096 tokens), then lets them all join, never after
    it ended."""
    name, sdk = tenant
    joined: dict[str, int] = {}

    class Recording(SimEngine):
        def add(self, request):  # type: ignore[no-untyped-def]
            text = bytes(request.prompt_token_ids).decode()
            joined[text[text.index("Doc") :]] = self.steps
            super().add(request)

    engine = decoding_engine(model, max_num_seqs=64)
    engine.__class__ = Recording
    documents = [f"Document {d}: " + "the lease runs for five years. " * 70 for d in range(3)]
    lines = [
        chat(model, f"d{d}-q{q}", f"{documents[d]}\nQuestion {q}?", 20)
        for q in range(4)
        for d in range(3)
    ]
    batch_id = make_batch(settings, name, lines)
    Runner(settings, engine, "w-leader").drain()
    for document in documents:
        steps = sorted(step for text, step in joined.items() if text.startswith(document))
        assert steps == [steps[0], steps[0] + 2, steps[0] + 2, steps[0] + 2], joined
    end(settings, sdk, batch_id, [f"d{d}-q{q}" for q in range(4) for d in range(3)])


def test_the_batch_shows_what_the_prefix_cache_saved(
    settings: Settings, model: str, tenant: tuple[str, OpenAI]
) -> None:
    """The batch's usage carries its prefix-cache hit rate and prompt tokens computed against
    the least possible (each prefix group's shared prefix once), and ``offpeak status`` shows
    them."""
    from rich.console import Console

    from offpeak.cli.client import print_summary

    name, sdk = tenant
    a = "You are a careful translator from French to English. " * 3
    b = "You are a terse assistant who answers in one word only. " * 3
    lines = [chat(model, f"q{i}", f"question {i}", 5, a if i % 2 else b) for i in range(30)]
    batch_id = make_batch(settings, name, lines)
    running = sdk.batches.retrieve(batch_id).usage
    assert running is not None and running.model_extra is not None
    assert running.model_extra["min_prompt_tokens"] is None  # known when the batch ends
    Runner(settings, decoding_engine(model, max_num_seqs=64), "w-saved").drain()
    batch = end(settings, sdk, batch_id, [f"q{i}" for i in range(30)])
    usage = batch.usage
    extra = usage.model_extra
    cached = usage.input_tokens_details.cached_tokens
    assert cached > 0
    assert extra["prefix_cache_hit_rate"] == round(cached / usage.input_tokens, 4) > 0.5
    assert extra["prompt_tokens_computed"] == usage.input_tokens - cached
    # Two system prompts: each computed once at the least, each line's question on top.
    least = extra["min_prompt_tokens"]
    assert 0 < least <= extra["prompt_tokens_computed"] < usage.input_tokens
    console = Console(record=True, width=200)
    print_summary(batch, console)
    shown = console.export_text()
    assert f"{100 * extra['prefix_cache_hit_rate']:.0f}% of prompt tokens cached" in shown
    assert f"{least:,})" in shown


def test_batch_object_shows_slack_and_estimated_completion(
    settings: Settings, model: str, tenant: tuple[str, OpenAI]
) -> None:
    name, sdk = tenant
    batch_id = make_batch(settings, name, [chat(model, f"r{i}", "Hi", 10) for i in range(5)])
    assert getattr(sdk.batches.retrieve(batch_id), "slack_seconds", None) is None
    at = time.time()
    sweep_estimates(settings, [model], at)
    batch = sdk.batches.retrieve(batch_id)
    eta, slack = batch.estimated_completion_at, batch.slack_seconds  # type: ignore[attr-defined]
    assert at <= eta <= batch.expires_at
    assert slack == pytest.approx(batch.expires_at - eta, abs=1.0) and slack > 0
    admin = settings.model_copy(update={"admin_api_key": "adm"})
    with TestClient(create_app(admin)) as client:
        view = client.get("/v1/admin/scheduler", headers={"Authorization": "Bearer adm"}).json()
    [row] = [b for b in view["batches"] if b["id"] == batch_id]
    assert row["remaining"] == 5 and row["slack_seconds"] == pytest.approx(slack, abs=1.0)
    Runner(settings, decoding_engine(model), "w-slack").drain()
    end(settings, sdk, batch_id, [f"r{i}" for i in range(5)])
    done = sdk.batches.retrieve(batch_id)
    assert getattr(done, "slack_seconds", None) is None  # only running batches have one


def test_an_estimate_skips_a_batch_whose_row_another_transaction_holds(
    settings: Settings, model: str, tenant: tuple[str, OpenAI]
) -> None:
    """The runner's loop saves estimates: it must not wait for a finalize or a write-back
    holding the batch's row; the next refresh stores the estimate instead."""
    name, _sdk = tenant
    batch_id = make_batch(settings, name, [chat(model, "r0", "Hi", 10)])
    url = settings.resolved_database_url
    with session_scope(url) as holder:  # holds the batch's row until the block ends
        holder.execute(select(Batch.id).where(Batch.id == batch_id).with_for_update())
        writer = threading.Thread(target=DbStore(url).save_estimates, args=({batch_id: 123.0},))
        writer.start()
        writer.join(timeout=10)
        assert not writer.is_alive(), "the estimate waited for the lock on the batch's row"
    with session_scope(url) as check:
        assert check.get(Batch, batch_id).estimated_completion_at is None  # type: ignore[union-attr]
    DbStore(url).save_estimates({batch_id: 456.0})
    with session_scope(url) as check:
        assert check.get(Batch, batch_id).estimated_completion_at == 456.0  # type: ignore[union-attr]


def test_lines_of_an_expired_batch_are_not_claimed(
    settings: Settings, model: str, tenant: tuple[str, OpenAI]
) -> None:
    name, sdk = tenant
    ids = [f"r{i}" for i in range(6)]
    batch_id = make_batch(settings, name, [chat(model, i, "Hi", 5) for i in ids], "60s")
    with session_scope(settings.resolved_database_url) as session:
        past = int(time.time()) - 1  # the window ran out before any worker came by
        session.execute(update(Batch).where(Batch.id == batch_id).values(expires_at=past))
        session.execute(
            update(RequestLine).where(RequestLine.batch_id == batch_id).values(deadline=past)
        )
    stats = Runner(settings, decoding_engine(model), "w-expired").drain()
    assert stats.requests == 0 and line_statuses(settings, batch_id) == {"pending": 6}
    batch = end(settings, sdk, batch_id, ids)
    assert batch.status == "expired"
    assert batch.request_counts.failed == 6 and batch.output_file_id is None


def test_work_that_fits_finishes_inside_a_60s_window_under_high_load(
    settings: Settings, model: str, tenant: tuple[str, OpenAI], endpoint: MetricsEndpoint
) -> None:
    """High load throughout: the batch waits while it has slack to spare, runs when its slack
    reaches the margin (half the window here), and still ends inside its 60 s window."""
    name, sdk = tenant
    settings = with_policy(settings, urgent_margin_fraction=0.5, expected_completion_tokens=40)
    endpoint.set(kv=0.95)
    ids = [f"r{i}" for i in range(64)]
    batch_id = make_batch(settings, name, [chat(model, i, "Hi", 40) for i in ids], "60s")
    engine = decoding_engine(model, max_num_seqs=32, base_ms=10, per_seq_ms=0.4)
    clock = engine.clock  # the runner's time: claims, deadlines and finish times use it
    runner = Runner(settings, engine, "w-window", clock=clock, step_model=StepModel(10, 0.4))
    created = sdk.batches.retrieve(batch_id).created_at
    while clock.time() < created + 75:
        stats = runner.drain()  # as the sweep's drain messages would, every half second
        if line_statuses(settings, batch_id).get("succeeded", 0) == 64:
            break
        assert stats.outcome == "yielded"
        clock.sleep(0.5)
    with session_scope(settings.resolved_database_url) as session:
        first_done, last_done = session.execute(
            select(func.min(RequestLine.finished_at), func.max(RequestLine.finished_at)).where(
                RequestLine.batch_id == batch_id
            )
        ).one()
    batch = end(settings, sdk, batch_id, ids)
    assert batch.status == "completed" and batch.request_counts.completed == 64
    assert last_done <= batch.expires_at  # inside the window, on the runner's clock
    # It held back while slack was above the margin: nothing ran in the first 20 s.
    assert first_done >= created + 20


def test_leases_outlive_slow_steps_and_lines_taken_over_are_dropped(
    settings: Settings, model: str, tenant: tuple[str, OpenAI]
) -> None:
    """An engine step outlasts the lease (it blocks until the test lets it go): the heartbeat
    keeps the leases, so another worker's claim past the first lease finds nothing. When the
    lines are taken over anyway, the runner drops them instead of running them for nothing.
    The heartbeat is a thread on the wall clock: this test runs in real time, but waits for
    events, not for durations."""
    name, _ = tenant
    settings = settings.model_copy(update={"lease_seconds": 1})
    batch_id = make_batch(settings, name, [chat(model, f"r{i}", "Hi", 2) for i in range(4)])
    engine = decoding_engine(model, max_num_seqs=4)
    inside, let_go = threading.Event(), threading.Event()
    first_step = engine.step

    def slow_step():  # type: ignore[no-untyped-def]
        engine.step = first_step  # only the first step hangs
        inside.set()
        assert let_go.wait(60)
        return first_step()

    engine.step = slow_step  # type: ignore[method-assign]
    runner = Runner(settings, engine, "w-slow")
    outcome: list[object] = []
    worker = threading.Thread(target=lambda: outcome.append(runner.drain()))
    worker.start()
    assert inside.wait(30), "the runner never stepped"

    def leases() -> list[float]:
        with session_scope(settings.resolved_database_url) as session:
            return list(
                session.scalars(
                    select(RequestLine.lease_expires_at).where(RequestLine.batch_id == batch_id)
                )
            )

    claimed = max(leases())  # the leases the claim took, before any renewal
    deadline = time.monotonic() + 30
    while min(leases()) <= claimed:  # inside the first step: only the heartbeat can renew
        assert time.monotonic() < deadline, "the heartbeat never renewed the leases"
        time.sleep(0.05)
    with session_scope(settings.resolved_database_url) as session:
        stolen = requests_repo.claim(
            session, model=model, limit=10, owner="w-other", lease_until=claimed + 60,
            at=claimed + 0.05,
        )  # fmt: skip  # past the first lease: taken, had the heartbeat not renewed it
    assert stolen == [], "the heartbeat let the leases lapse"
    with session_scope(settings.resolved_database_url) as session:
        session.execute(
            update(RequestLine)
            .where(RequestLine.batch_id == batch_id)
            .values(lease_owner="w-thief", lease_expires_at=time.time() + 60)
        )
    let_go.set()
    worker.join(timeout=30)
    assert not worker.is_alive()
    [stats] = outcome
    assert stats.requests == 0  # type: ignore[attr-defined]
    assert line_statuses(settings, batch_id) == {"running": 4}  # the thief's, untouched
