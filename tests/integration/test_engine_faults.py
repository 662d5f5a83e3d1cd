"""A failing engine never fails a user's lines: the runner hands them back, the worker rebuilds
its engine, and only a line that kills the engine again and again fails, alone. On real
PostgreSQL, with engines that fail on purpose."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
import pytest
from openai import OpenAI
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

import migrations
from offpeak.settings import ModelConfig, SchedulerSettings, Settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.models import RequestLine
from storage.repositories import requests as requests_repo
from storage.repositories.requests import FinishedLine, TokenCounts
from tests.integration.test_runner import make
from tests.support.batches import check_billed_once, check_ran_batch, line, tenant_client
from tests.support.servers import PostgresServer
from workers.engine.base import EngineFault, EngineRequest, EngineResult
from workers.engine.instant import InstantEngine
from workers.finalize import finalize
from workers.runner import Runner
from workers.scheduler.store import DbStore, WriteBack, WriteBackReport

#: A model of its own: lines this module leaves pending never reach test_runner.py's runners.
MODEL = "faults-model"


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"models": {MODEL: ModelConfig(engine="instant")}, "flush_seconds": 0.05}
    )


@pytest.fixture()
def tenant_sdk(settings: Settings) -> tuple[str, OpenAI]:
    return tenant_client(settings)


class DyingEngine(InstantEngine):
    """Finishes one request per step; its ``step`` raises (as vLLM's ``EngineDeadError`` does
    once the engine-core process is gone) when ``dies(step_number, queued)`` says so, and from
    then on every call fails, like a dead engine."""

    def __init__(
        self,
        dies: Callable[[int, dict[str, EngineRequest]], bool],
        delay: float = 0.0,
        model: str = MODEL,
    ) -> None:
        super().__init__(model)
        self.dies = dies
        self.delay = delay
        self.steps = 0
        self.dead = False

    def _check(self) -> None:
        if self.dead:
            raise RuntimeError("EngineCore encountered an issue (engine dead)")

    def add(self, request: EngineRequest) -> None:
        self._check()
        super().add(request)

    def abort(self, request_ids: list[str]) -> None:
        self._check()
        super().abort(request_ids)

    def step(self) -> list[EngineResult]:
        self._check()
        time.sleep(self.delay)
        self.steps += 1
        if self.dies(self.steps, self._queued):
            self.dead = True
            self._check()
        if not self._queued:
            return []
        first = next(iter(self._queued))
        keep = {k: v for k, v in self._queued.items() if k != first}
        self._queued = {first: self._queued[first]}
        results = super().step()
        self._queued = keep
        return results


def drain_with_recovery(
    settings: Settings, make_engine: Callable[[], InstantEngine], rounds: int = 20
) -> tuple[Runner, int]:
    """What ``workers.tasks.drain_model`` does: drain; on ``EngineFault`` put a new engine in
    the same runner and drain again. Returns the runner and the number of engine failures."""
    runner = Runner(settings, make_engine(), "w-faults")
    failures = 0
    for _ in range(rounds):
        try:
            stats = runner.drain()
        except EngineFault:
            failures += 1
            runner.replace_engine(make_engine())
            continue
        if stats.outcome == "drained":
            return runner, failures
    raise AssertionError("the runner never drained")


def rows(settings: Settings, batch_id: str) -> list[RequestLine]:
    with session_scope(settings.resolved_database_url) as session:
        return list(session.scalars(select(RequestLine).where(RequestLine.batch_id == batch_id)))


def test_a_dead_engine_hands_every_line_back_and_a_new_one_finishes_them(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    tenant, sdk = tenant_sdk
    ids = [f"r{i}" for i in range(40)]
    batch_id = make(settings, tenant, [line(i, model=MODEL) for i in ids])
    first = DyingEngine(lambda step, _queued: step == 10)  # dies with 30 lines inside it
    runner = Runner(settings, first, "w-dead")
    with pytest.raises(EngineFault) as raised:
        runner.drain()
    assert raised.value.suspects, "the lines inside the dead engine are named"
    states = [r.status for r in rows(settings, batch_id)]
    assert "failed" not in states, "a line was failed for the engine's fault"
    assert "running" not in states, "held lines must go back to pending, not wait for a lease"
    assert states.count("succeeded") == 9

    # Every later call on the dead engine fails too: the runner must not fail lines with it.
    runner.replace_engine(DyingEngine(lambda _step, _queued: False))
    assert runner.drain().outcome == "drained"
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    batch = sdk.batches.retrieve(batch_id)
    output, errors = check_ran_batch(sdk, batch, ids)
    assert batch.status == "completed" and len(output) == 40 and not errors
    check_billed_once(settings.resolved_database_url, batch)


def test_a_dead_engine_refusing_add_fails_no_line(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    """Before: ``add`` raising anything but ValueError failed the line with 500 internal_error,
    so a dead engine failed every line of every later batch."""
    tenant, sdk = tenant_sdk
    ids = [f"r{i}" for i in range(12)]
    batch_id = make(settings, tenant, [line(i, model=MODEL) for i in ids])
    dead = DyingEngine(lambda _step, _queued: False)
    dead.dead = True
    runner = Runner(settings, dead, "w-add")
    with pytest.raises(EngineFault):
        runner.drain()
    assert {r.status for r in rows(settings, batch_id)} == {"pending"}
    runner.replace_engine(InstantEngine(MODEL))
    runner.drain()
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    output, errors = check_ran_batch(sdk, sdk.batches.retrieve(batch_id), ids)
    assert len(output) == 12 and not errors


def test_a_poison_line_fails_alone_after_max_attempts(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    tenant, sdk = tenant_sdk
    settings = settings.model_copy(update={"max_line_attempts": 3})
    ids = [f"r{i}" for i in range(30)]
    lines = [line(i, model=MODEL) for i in ids]
    lines[7] = line("r7", model=MODEL, body_messages=[{"role": "user", "content": "POISON"}])
    batch_id = make(settings, tenant, lines)

    def poisoned(_step: int, queued: dict[str, EngineRequest]) -> bool:
        # The engine dies at the first step that runs the poison line.
        return any(b"POISON" in bytes(r.prompt_token_ids) for r in queued.values())

    _, failures = drain_with_recovery(settings, lambda: DyingEngine(poisoned))
    assert failures == 3, "the poison line is retried max_line_attempts times, then failed"
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    batch = sdk.batches.retrieve(batch_id)
    output, errors = check_ran_batch(sdk, batch, ids)
    assert batch.status == "completed" and len(output) == 29
    [error] = errors
    assert error["custom_id"] == "r7" and error["response"]["status_code"] == 500
    body = error["response"]["body"]["error"]
    assert body["code"] == "engine_failure" and body["type"] == "server_error"
    assert "3 times" in body["message"]
    check_billed_once(settings.resolved_database_url, batch)
    innocent = [r.attempts for r in rows(settings, batch_id) if r.custom_id != "r7"]
    assert max(innocent) <= 2, "an innocent line was inside more than one engine failure"


def test_engine_errors_on_a_line_are_server_errors(
    settings: Settings, tenant_sdk: tuple[str, OpenAI], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 5xx line is ``server_error``; a 4xx line stays ``invalid_request_error``."""
    from workers import engine_io

    tenant, sdk = tenant_sdk
    batch_id = make(
        settings,
        tenant,
        [
            line("ok", model=MODEL),
            line("bug", model=MODEL),
            line("hot", model=MODEL, body_temperature=5),
        ],
    )
    real = engine_io.prepare

    def buggy(request_id: str, endpoint: str, body: dict, engine: object, *a, **k):  # type: ignore[no-untyped-def]
        if body["messages"][0]["content"] == "Hi" and not buggy.done:  # type: ignore[attr-defined]
            buggy.done = True  # type: ignore[attr-defined]
            raise RuntimeError("a bug in preparation")
        return real(request_id, endpoint, body, engine, *a, **k)  # type: ignore[arg-type]

    buggy.done = False  # type: ignore[attr-defined]
    monkeypatch.setattr(engine_io, "prepare", buggy)
    Runner(settings, InstantEngine(MODEL), "w-types").drain()
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    _, errors = check_ran_batch(sdk, sdk.batches.retrieve(batch_id), ["ok", "bug", "hot"])
    types = {e["response"]["status_code"]: e["response"]["body"]["error"]["type"] for e in errors}
    assert types == {500: "server_error", 400: "invalid_request_error"}


def test_renewal_renews_only_the_lines_held(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    """A row the worker failed to hand back (the database was down) is no longer held in
    memory: its lease must lapse so another worker runs it, not be renewed forever."""
    tenant, _ = tenant_sdk
    batch_id = make(settings, tenant, [line(f"r{i}", model=MODEL) for i in range(4)])
    url = settings.resolved_database_url
    with session_scope(url) as session:
        claimed = requests_repo.claim(
            session,
            model=MODEL,
            limit=4,
            owner="w-renew",
            lease_until=time.time() + 5,
            at=time.time(),
        )
    assert len(claimed) == 4
    held, orphan = [r.id for r in claimed[:3]], claimed[3].id
    store = DbStore(url)
    assert store.renew("w-renew", time.time() + 600, held) == 3
    written = store.write_back(
        WriteBack(
            owner="w-renew",
            model=MODEL,
            device="cpu",
            at=time.time(),
            lease_until=time.time() + 600,
            results=[],
            per_batch={},
            started_at=time.time(),
            busy_seconds=0.0,
            batch_ids={batch_id},
            held_ids=held,
        )
    )
    assert isinstance(written, WriteBackReport) and written.lost == []
    leases = {r.id: r.lease_expires_at for r in rows(settings, batch_id)}
    assert all(leases[i] > time.time() + 500 for i in held)
    assert leases[orphan] < time.time() + 10, "a line not held was renewed"


def test_a_raw_psycopg_outage_in_write_back_keeps_the_results(
    settings: Settings, tenant_sdk: tuple[str, OpenAI], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unnest write-back uses a raw psycopg cursor: its ``OperationalError`` is psycopg's,
    which ``(sqlalchemy OperationalError, DBAPIError)`` did not catch; the drain died."""
    tenant, sdk = tenant_sdk
    ids = [f"r{i}" for i in range(10)]
    batch_id = make(settings, tenant, [line(i, model=MODEL) for i in ids])
    real, outages = DbStore.write_back, [3]

    def flaky(self: DbStore, flush: WriteBack) -> WriteBackReport:
        if flush.results and outages[0] > 0:
            outages[0] -= 1
            raise psycopg.OperationalError("the database system is shutting down")
        return real(self, flush)

    monkeypatch.setattr(DbStore, "write_back", flaky)
    stats = Runner(settings, InstantEngine(MODEL), "w-outage").drain()
    assert stats.outcome == "drained" and outages == [0]
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    output, errors = check_ran_batch(sdk, sdk.batches.retrieve(batch_id), ids)
    assert len(output) == 10 and not errors


def test_a_wrong_write_is_not_retried_forever(
    settings: Settings, tenant_sdk: tuple[str, OpenAI], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``IntegrityError`` fails the same way every time: the drain raises (lines go back to
    pending for a fixed worker) instead of looping on it."""
    tenant, _ = tenant_sdk
    batch_id = make(settings, tenant, [line(f"r{i}", model=MODEL) for i in range(5)])

    def wrong(self: DbStore, flush: WriteBack) -> WriteBackReport:
        raise IntegrityError("UPDATE requests", {}, Exception("violates check constraint"))

    monkeypatch.setattr(DbStore, "write_back", wrong)
    with pytest.raises(IntegrityError):
        Runner(settings, InstantEngine(MODEL), "w-wrong").drain()
    monkeypatch.undo()
    assert {r.status for r in rows(settings, batch_id)} == {"pending"}


class BlockingMetrics:
    """A Prometheus endpoint whose first scrape answers and every later one hangs until
    ``release`` (a real-time server's /metrics stuck behind its own load)."""

    def __init__(self) -> None:
        self.scrapes = 0
        self.blocked = threading.Event()
        self.released = threading.Event()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                endpoint.scrapes += 1
                if endpoint.scrapes > 1:
                    endpoint.blocked.set()
                    endpoint.released.wait(60)
                body = b"vllm:num_requests_running 0\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()


def test_a_slow_load_signal_does_not_stall_the_engine(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    tenant, _ = tenant_sdk
    endpoint = BlockingMetrics()
    policy = SchedulerSettings(load_signals=["prometheus"], load_poll_seconds=0.05)
    policy.prometheus.url = endpoint.url
    policy.prometheus.timeout_seconds = 30.0
    settings = settings.model_copy(update={"scheduler": policy})
    make(settings, tenant, [line(f"r{i}", model=MODEL) for i in range(400)])
    # 5 ms steps: the 400 lines outlast the scrape that hangs (a step a little like a GPU's).
    engine = DyingEngine(lambda _step, _queued: False, delay=0.005)
    worker = threading.Thread(target=Runner(settings, engine, "w-slow-signal").drain)
    try:
        worker.start()
        assert endpoint.blocked.wait(30), "the second scrape never came"
        steps = engine.steps
        deadline = time.monotonic() + 20
        while engine.steps < steps + 20:
            assert time.monotonic() < deadline, "the engine stopped stepping during a scrape"
            time.sleep(0.01)
    finally:
        endpoint.close()
        worker.join(timeout=60)


def test_a_stop_request_hands_every_held_line_back(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    """SIGTERM on an engine worker sets the stop request: the runner writes back what
    finished, hands the rest back to pending unrun (no attempt counted) and returns."""
    from workers import lifecycle

    tenant, _ = tenant_sdk
    batch_id = make(settings, tenant, [line(f"r{i}", model=MODEL) for i in range(200)])
    engine = DyingEngine(lambda step, _queued: (step == 20 and lifecycle.request_stop()) or False)
    try:
        stats = Runner(settings, engine, "w-stop").drain()
    finally:
        lifecycle.reset()
    assert stats.outcome == "stopped"
    states = [(r.status, r.attempts) for r in rows(settings, batch_id)]
    assert {s for s, _ in states} == {"succeeded", "pending"}
    assert {a for s, a in states if s == "pending"} == {0}, "a stop is not a failed attempt"
    assert 15 <= sum(s == "succeeded" for s, _ in states) <= 20


def test_a_stop_during_a_database_outage_writes_back_what_finished_once_it_is_back(
    settings: Settings, tenant_sdk: tuple[str, OpenAI], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injected: SIGTERM's stop request (with its deadline) comes while the database is
    unreachable, so the stop's write-back fails. The runner tries again every
    ``flush_seconds`` until it is back, within the deadline: the finished lines are stored
    (once), not left leased to be run again after their leases."""
    from sqlalchemy.exc import OperationalError

    from workers import lifecycle

    # A model of its own: lines other tests handed back to pending stay out of this drain.
    model = "faults-outage-model"
    settings = settings.model_copy(
        update={"models": {**settings.models, model: ModelConfig(engine="instant")}}
    )
    tenant, _ = tenant_sdk
    batch_id = make(settings, tenant, [line(f"r{i}", model=model) for i in range(200)])
    write_back = DbStore.write_back
    refused: list[int] = []

    def down_after_the_stop(self: DbStore, write: WriteBack) -> WriteBackReport:
        if lifecycle.stop_requested() and len(refused) < 3:
            refused.append(len(write.results))
            raise OperationalError("UPDATE", {}, Exception("connection refused"))
        return write_back(self, write)

    monkeypatch.setattr(DbStore, "write_back", down_after_the_stop)
    engine = DyingEngine(
        lambda step, _queued: (step == 20 and lifecycle.request_stop(within=30.0)) or False,
        model=model,
    )
    try:
        stats = Runner(settings, engine, "w-stop-outage").drain()
    finally:
        lifecycle.reset()
    assert stats.outcome == "stopped" and len(refused) == 3 and refused[0] > 0
    states = [(r.status, r.attempts) for r in rows(settings, batch_id)]
    succeeded = sum(s == "succeeded" for s, _ in states)
    assert 15 <= succeeded <= 20, states  # what finished before the stop, stored after it
    assert {s for s, _ in states} == {"succeeded", "pending"}
    assert {a for s, a in states if s == "pending"} == {0}, "a stop is not a failed attempt"


def test_release_and_claim_count_attempts_of_crashes_only(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    tenant, _ = tenant_sdk
    batch_id = make(settings, tenant, [line("r0", model=MODEL)])

    def claim_and_release(count_attempt: bool) -> int:
        with session_scope(settings.resolved_database_url) as session:
            [row] = requests_repo.claim(
                session,
                model=MODEL,
                limit=1,
                owner="w",
                lease_until=time.time() + 60,
                at=time.time(),
                batch_ids=[batch_id],
            )
            requests_repo.release(session, "w", [row.id], count_attempt=count_attempt)
        return row.attempts

    assert [claim_and_release(True) for _ in range(2)] == [1, 2]  # two crashes
    assert claim_and_release(False) == 3  # the third run, handed back unrun
    assert [r.attempts for r in rows(settings, batch_id)] == [2]


def test_a_worker_whose_lease_was_taken_over_bills_nothing_for_it(
    settings: Settings, tenant_sdk: tuple[str, OpenAI]
) -> None:
    """A stalled worker whose lines another worker took over and finished writes back late:
    its results are refused, and its engine time must not add a second share of those lines'
    tokens to the batch (the bill is made from the shares)."""
    tenant, sdk = tenant_sdk
    ids = [f"r{i}" for i in range(6)]
    batch_id = make(settings, tenant, [line(i, model=MODEL) for i in ids])
    url = settings.resolved_database_url
    with session_scope(url) as session:  # worker A claims, then stalls past its lease
        stalled = requests_repo.claim(
            session,
            model=MODEL,
            limit=6,
            owner="stalled",
            lease_until=time.time() - 1,
            at=time.time(),
            batch_ids=[batch_id],
        )
    Runner(settings, InstantEngine(MODEL), "w-took-over").drain()  # B runs every line
    late = [
        FinishedLine(r.id, r.batch_id, "succeeded", time.time(), 200, "{}", TokenCounts(9, 0, 9))
        for r in stalled
    ]
    from storage.repositories.engine_chunks import tokens_by_batch

    DbStore(url).write_back(  # A wakes up and writes its results with its engine seconds
        WriteBack(
            owner="stalled",
            model=MODEL,
            device="cpu",
            at=time.time(),
            lease_until=time.time() + 60,
            results=late,
            per_batch=tokens_by_batch(late),
            started_at=time.time() - 5,
            busy_seconds=5.0,
        )
    )
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    batch = sdk.batches.retrieve(batch_id)
    output, _ = check_ran_batch(sdk, batch, ids)
    assert len(output) == 6
    check_billed_once(url, batch)


@pytest.fixture()
def own_server_settings(settings: Settings, own_postgres: PostgresServer) -> Iterator[Settings]:
    """``settings`` on a database of a PostgreSQL server of this module's own, free to stop."""
    url = own_postgres.create_database(f"offpeak_faults_{secrets.token_hex(3)}")
    migrations.upgrade(url)
    yield settings.model_copy(update={"database_url": url})
    from storage.db import get_engine, get_read_engine

    get_engine(url).dispose()  # this process's pools, before the server goes away
    get_read_engine(url).dispose()


def test_a_stop_while_the_database_server_is_down_loses_nothing_and_runs_nothing_twice(
    own_server_settings: Settings, own_postgres: PostgresServer
) -> None:
    """Fault injected for real: the PostgreSQL server is stopped (``pg_ctl -m fast``: open
    connections cut) while a drain runs, and SIGTERM's stop request (with its deadline) comes
    during the outage; the server starts again 2 s later. The stopping runner's write-backs and
    hand-back fail until then and are tried again: the finished lines are stored, the rest go
    back to pending, and a second worker finishes the batch with every custom_id once in the
    files and every line billed once (the injected-error test above is the unit version)."""
    from workers import lifecycle

    settings = own_server_settings
    tenant, sdk = tenant_client(settings)
    ids = [f"r{i}" for i in range(200)]
    batch_id = make(settings, tenant, [line(i, model=MODEL) for i in ids])
    back = threading.Event()

    def outage(step: int, _queued: dict[str, EngineRequest]) -> bool:
        if step == 20:
            own_postgres.stop("fast")  # returns once the server is down
            lifecycle.request_stop(within=30.0)

            def start_again() -> None:
                own_postgres.start()
                back.set()

            threading.Timer(2.0, start_again).start()
        return False

    try:
        stats = Runner(settings, DyingEngine(outage), "w-real-outage").drain()
    finally:
        lifecycle.reset()
        back.wait(timeout=60)
    assert back.is_set() and stats.outcome == "stopped"
    states = [(r.status, r.attempts) for r in rows(settings, batch_id)]
    assert {s for s, _ in states} == {"succeeded", "pending"}, "none left leased or failed"
    assert 15 <= sum(s == "succeeded" for s, _ in states) <= 20, states
    assert {a for s, a in states if s == "pending"} == {0}, "a stop is not a failed attempt"

    assert Runner(settings, InstantEngine(MODEL), "w-after").drain().outcome == "drained"
    assert finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id).done
    batch = sdk.batches.retrieve(batch_id)
    output, errors = check_ran_batch(sdk, batch, ids)
    assert batch.status == "completed" and len(output) == 200 and not errors
    check_billed_once(settings.resolved_database_url, batch)
