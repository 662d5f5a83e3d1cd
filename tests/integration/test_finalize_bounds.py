"""Bounded messages and files written once.

- A burst of validated batches queues one drain per model, not one per batch; sweeps add none.
- A cancelling batch whose lines a worker holds keeps one finalize chain, however many sweeps
  pass; a lost message is re-sent once its record counts as lost, so nothing is ever stuck.
- Two finalizes racing on one batch (or one that crashed before its commit, then a re-run) leave
  one output and one error file in ``files.list``, and one bill.

Messages are counted in the Redis queues themselves (``LLEN``) and run by popping them as a worker
would, so the tests see what the broker holds. The tasks are called in-process on the instant
engine; each test has its own queue prefix and the module its own database.
"""

from __future__ import annotations

import base64
import io
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from openai import OpenAI
from sqlalchemy import func, select, update

import migrations
from api.app import create_app
from api.schemas.batches import CreateBatch
from api.services import batches as batches_service
from api.services import files as files_service
from api.services import keys
from offpeak import celery_app
from offpeak.settings import ModelConfig, Settings, get_settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.models import Batch, File, LedgerEntry, TaskMessage
from storage.repositories import batches as batches_repo
from storage.repositories import requests as requests_repo
from tests.support.batches import line
from tests.support.database import fresh_database, settings_from
from workers.finalize import finalize
from workers.validation import run_validation

MODEL = "bounds-model"
#: A worker that holds lines and never finishes them on its own (it is not running here).
HOLDER = "holder:1"


@pytest.fixture(scope="module")
def module_settings(base_env: dict[str, str], run_id: str) -> Iterator[Settings]:
    """Its own database: the sweep acts on every batch it finds."""
    with fresh_database(f"offpeak_{run_id}_bounds") as url:
        yield settings_from({**base_env, "OFFPEAK_DATABASE_URL": url})


@pytest.fixture()
def settings(module_settings: Settings, run_id: str) -> Iterator[Settings]:
    prefix = f"{run_id}-bounds-{secrets.token_hex(3)}"
    yield module_settings.model_copy(
        update={
            "queue_prefix": prefix,
            "models": {MODEL: ModelConfig(engine="instant")},
            "flush_seconds": 0.05,
        }
    )
    client = redis.Redis.from_url(module_settings.resolved_broker_url)
    for key in client.scan_iter(f"*{prefix}*"):
        client.delete(key)


@pytest.fixture()
def tasks(
    settings: Settings, base_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """``workers.tasks``, imported with the test environment (its Celery app reads the settings
    at import) and reading ``settings``; its drains run on an engine worker of the test's own
    (no runner, and its settings, outlives the test)."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in base_env.items():
            env.setenv(name, value)
        get_settings.cache_clear()
        import workers.tasks as module
    get_settings.cache_clear()
    from workers import engine_worker

    monkeypatch.setattr(module, "get_settings", lambda: settings)
    previous = engine_worker.install(engine_worker.EngineWorker(settings))
    yield module
    engine_worker.install(previous)


@dataclass
class Message:
    task: str
    args: list[Any]
    kwargs: dict[str, Any]


def _decode(raw: Any) -> Message:
    """A kombu Redis envelope around a Celery protocol-2 body ``[args, kwargs, embed]``."""
    envelope = json.loads(raw)
    body = envelope["body"]
    if envelope["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args, kwargs, _embed = json.loads(body)
    return Message(envelope["headers"]["task"], args, kwargs)


class Broker:
    """The test's view of the Redis queues: count, peek, and run messages as a worker would."""

    def __init__(self, settings: Settings) -> None:
        self.client = redis.Redis.from_url(settings.resolved_broker_url)
        self.control = celery_app.control_queue(settings)
        self.model = celery_app.model_queue(settings, MODEL)

    def messages(self, queue: str) -> list[Message]:
        return [_decode(raw) for raw in self.client.lrange(queue, 0, -1)]

    def count(self, queue: str, task: str) -> int:
        return sum(m.task == task for m in self.messages(queue))

    def lose(self, queue: str) -> None:
        """A broker restart that loses what the queue held."""
        self.client.delete(queue)

    def run(self, queue: str, tasks: ModuleType, only: str | None = None) -> int:
        """Pop what ``queue`` holds now (oldest first, as kombu's ``BRPOP``) and run each task
        (countdowns are not waited for); messages the tasks send meanwhile stay queued."""
        ran = 0
        by_name: dict[str, Callable[..., None]] = {
            celery_app.VALIDATE_TASK: tasks.validate_batch,
            celery_app.DRAIN_TASK: tasks.drain_model,
            celery_app.FINALIZE_TASK: tasks.finalize_batch,
        }
        for _ in range(self.client.llen(queue)):
            raw = self.client.rpop(queue)
            if raw is None:
                break
            message = _decode(raw)
            if only is not None and message.task != only:
                continue
            by_name[message.task](*message.args, **message.kwargs)
            ran += 1
        return ran


def _create_batches(settings: Settings, data: bytes, n: int) -> tuple[str, list[str]]:
    """``n`` batches on one uploaded input file, not yet validated (their validation messages
    are dropped: the test runs the task). Returns the tenant name and the batch ids."""
    blobs = get_blob_store(settings.resolved_blob_url)
    name = f"bounds-{secrets.token_hex(4)}"
    with session_scope(settings.resolved_database_url) as session:
        tenant = keys.ensure_tenant(session, name)
        file = files_service.upload(
            session,
            blobs,
            settings,
            tenant_id=tenant.id,
            stream=io.BytesIO(data),
            filename="in.jsonl",
            purpose="batch",
            expires_after_seconds=None,
        )
        request = CreateBatch(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        ids = [batches_service.create(session, settings, tenant.id, request).id for _ in range(n)]
        session.info.pop("after_commit", None)
    return name, ids


def _status(settings: Settings, batch_id: str) -> str:
    with session_scope(settings.resolved_database_url) as session:
        return str(session.scalar(select(Batch.status).where(Batch.id == batch_id)))


def test_a_burst_of_validated_batches_queues_one_drain(
    settings: Settings, tasks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Counting, not loss: no queued message may count as lost while the test runs (on a loaded
    # machine 200 finalizes outlasted the 60 s first wait, and the last send re-sent the sweep's
    # drain as lost). Re-sending lost messages is tested below.
    monkeypatch.setattr(celery_app, "FIRST_WAIT_SWEEPS", 10_000)
    broker = Broker(settings)
    _, batch_ids = _create_batches(settings, line("r0", model=MODEL), 200)
    for batch_id in batch_ids:
        tasks.validate_batch(batch_id)
    # One drain runs every batch validated before it starts: 200 messages were 199 too many.
    assert broker.count(broker.model, celery_app.DRAIN_TASK) == 1
    for _ in range(3):
        tasks.sweep()
    assert broker.count(broker.model, celery_app.DRAIN_TASK) == 1

    assert broker.run(broker.model, tasks) == 1  # the drain runs all 200 lines
    # Starting while they waited, it queued one more for a second engine worker to join
    # (``drain_model``'s baton); run after it, that one finds none pending and queues nothing.
    assert broker.count(broker.model, celery_app.DRAIN_TASK) == 1
    assert broker.run(broker.model, tasks) == 1
    assert broker.count(broker.model, celery_app.DRAIN_TASK) == 0
    # The drain sends one finalize per batch it touched; a sweep finds the same batches done
    # but not finalized (``finished_but_running``) and adds none while those are queued.
    tasks.sweep()
    assert broker.count(broker.control, celery_app.FINALIZE_TASK) == 200
    broker.run(broker.control, tasks)
    assert {_status(settings, b) for b in batch_ids} == {"completed"}
    assert broker.count(broker.control, celery_app.FINALIZE_TASK) == 0

    # The drain cleared its record as it started: the next batch queues the next drain.
    _, (late,) = _create_batches(settings, line("r0", model=MODEL), 1)
    tasks.validate_batch(late)
    assert broker.count(broker.model, celery_app.DRAIN_TASK) == 1


def _held_cancelling_batch(settings: Settings) -> tuple[str, list[int]]:
    """A 3-line batch, 2 lines held by a live worker (``HOLDER``), then cancelled through the
    API's service (which sends its finalize). Returns the batch id and the held row ids."""
    _, (batch_id,) = _create_batches(
        settings, b"\n".join(line(f"r{i}", model=MODEL) for i in range(3)), 1
    )
    run_validation(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    at = time.time()
    with session_scope(settings.resolved_database_url) as session:
        held = requests_repo.claim(
            session, model=MODEL, limit=2, owner=HOLDER, lease_until=at + 3600, at=at,
            batch_ids=[batch_id],
        )  # fmt: skip
    with session_scope(settings.resolved_database_url) as session:
        tenant_id = session.scalar(select(Batch.tenant_id).where(Batch.id == batch_id))
        assert tenant_id is not None
        batches_service.cancel(session, settings, tenant_id, batch_id)
    return batch_id, [row.id for row in held]


def _hand_back(settings: Settings, row_ids: list[int]) -> None:
    with session_scope(settings.resolved_database_url) as session:
        requests_repo.release(session, HOLDER, row_ids)


def test_a_cancelling_batch_keeps_one_finalize_chain(settings: Settings, tasks: Any) -> None:
    broker = Broker(settings)
    batch_id, held = _held_cancelling_batch(settings)
    for _ in range(5):
        tasks.sweep()  # each sweep used to start another chain of once-a-second finalizes
        assert broker.count(broker.control, celery_app.FINALIZE_TASK) == 1
        assert broker.run(broker.control, tasks, only=celery_app.FINALIZE_TASK) == 1
        assert _status(settings, batch_id) == "cancelling"  # its held lines keep it waiting
        assert broker.count(broker.control, celery_app.FINALIZE_TASK) == 1  # the chain's next look
        assert broker.count(broker.model, celery_app.DRAIN_TASK) <= 1
    _hand_back(settings, held)
    broker.run(broker.control, tasks, only=celery_app.FINALIZE_TASK)
    assert _status(settings, batch_id) == "cancelled"
    assert broker.count(broker.control, celery_app.FINALIZE_TASK) == 0  # the chain ended with it


def test_a_lost_finalize_is_sent_again_once_its_record_is_stale(
    settings: Settings, tasks: Any
) -> None:
    broker = Broker(settings)
    batch_id, held = _held_cancelling_batch(settings)
    broker.lose(broker.control)  # the broker restarted: the cancel's finalize is gone
    tasks.sweep()
    assert broker.count(broker.control, celery_app.FINALIZE_TASK) == 0  # it may still be on its way
    key = celery_app.finalize_key(batch_id)
    with session_scope(settings.resolved_database_url) as session:
        record = session.get(TaskMessage, key)
        assert record is not None
        first_wait = record.wait_seconds
        # As if ``first_wait`` seconds had passed with the message unstarted.
        session.execute(
            update(TaskMessage).where(TaskMessage.key == key).values(resend_at=time.time())
        )
    tasks.sweep()
    assert broker.count(broker.control, celery_app.FINALIZE_TASK) == 1
    with session_scope(settings.resolved_database_url) as session:
        record = session.get(TaskMessage, key)
        assert record is not None and record.wait_seconds == 2 * first_wait  # re-sent more rarely
    _hand_back(settings, held)
    broker.run(broker.control, tasks, only=celery_app.FINALIZE_TASK)
    assert _status(settings, batch_id) == "cancelled"


def test_a_lost_drain_is_sent_again_once_its_record_is_stale(
    settings: Settings, tasks: Any
) -> None:
    broker = Broker(settings)
    _, (batch_id,) = _create_batches(settings, line("r0", model=MODEL), 1)
    tasks.validate_batch(batch_id)
    broker.lose(broker.model)
    tasks.sweep()
    assert broker.count(broker.model, celery_app.DRAIN_TASK) == 0
    with session_scope(settings.resolved_database_url) as session:
        session.execute(
            update(TaskMessage)
            .where(TaskMessage.key == celery_app.drain_key(MODEL))
            .values(resend_at=time.time())
        )
    tasks.sweep()
    assert broker.run(broker.model, tasks) == 1
    broker.run(broker.control, tasks, only=celery_app.FINALIZE_TASK)
    assert _status(settings, batch_id) == "completed"


# --- Files written once --------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db_settings(
    request: pytest.FixtureRequest, settings: Settings, tmp_path: Path
) -> Iterator[Settings]:
    """The embedded default (SQLite) and PostgreSQL."""
    if request.param == "postgresql":
        yield settings
        return
    url = f"sqlite:///{tmp_path / 'offpeak.db'}"
    migrations.upgrade(url)
    yield settings.model_copy(update={"database_url": url, "data_dir": tmp_path})
    from storage.db import get_engine

    get_engine(url).dispose()


def test_reserve_sends_only_missing_lost_or_overtaken_keys(any_db_settings: Settings) -> None:
    """The record's rules in one statement, on both databases: a fresh record holds a send back,
    a lost one lets it through (doubling its wait), a sooner message overtakes a later one."""
    from storage.repositories import task_messages as task_messages_repo

    url = any_db_settings.resolved_database_url
    tag = secrets.token_hex(3)
    fresh, lost, later, new = (f"{tag}:{name}" for name in ("fresh", "lost", "later", "new"))

    def reserve(keys: list[str], *, now: float, due_at: float, sooner: bool) -> list[str]:
        with session_scope(url) as session:
            return task_messages_repo.reserve(
                session, keys, mark=f"m{now}", now=now, due_at=due_at, wait_seconds=10,
                max_wait_seconds=25, sooner=sooner,
            )  # fmt: skip

    assert sorted(reserve([fresh, lost], now=100, due_at=100, sooner=False)) == [fresh, lost]
    assert reserve([later], now=100, due_at=105, sooner=True) == [later]
    # Records resend at 110 (``fresh``, ``lost``) and 115 (``later``): at 104 only ``new`` goes.
    assert reserve([fresh, later, new], now=104, due_at=104, sooner=False) == [new]
    assert reserve([later], now=104, due_at=104, sooner=True) == [later]  # overtakes due 105
    assert reserve([later], now=104.5, due_at=105.5, sooner=True) == []  # one is due sooner
    assert reserve([lost], now=110, due_at=110, sooner=False) == [lost]
    with session_scope(url) as session:
        record = session.get(TaskMessage, lost)
        assert record is not None
        assert (record.wait_seconds, record.resend_at, record.mark) == (20, 130, "m110")
    assert reserve([lost], now=129, due_at=129, sooner=False) == []
    assert reserve([lost], now=130, due_at=130, sooner=False) == [lost]
    with session_scope(url) as session:
        record = session.get(TaskMessage, lost)
        assert record is not None and record.wait_seconds == 25  # doubled, up to the cap
        assert task_messages_repo.release(session, [lost], "m110") == 0  # an older message's mark
        assert task_messages_repo.release(session, [lost], "m130") == 1
    assert reserve([lost], now=131, due_at=131, sooner=False) == [lost]


def _half_run_cancelled_batch(settings: Settings) -> str:
    """A 4-line batch: 2 lines succeeded, then cancelled, so it ends with both files."""
    _, (batch_id,) = _create_batches(
        settings, b"\n".join(line(f"r{i}", model=MODEL) for i in range(4)), 1
    )
    run_validation(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    at = time.time()
    with session_scope(settings.resolved_database_url) as session:
        rows = requests_repo.claim(
            session, model=MODEL, limit=2, owner="w1", lease_until=at + 60, at=at,
            batch_ids=[batch_id],
        )  # fmt: skip
        requests_repo.write_results(
            session,
            "w1",
            [
                requests_repo.FinishedLine(
                    id=row.id,
                    batch_id=row.batch_id,
                    status="succeeded",
                    finished_at=at,
                    status_code=200,
                    result=json.dumps({"custom_id": row.custom_id, "error": None}),
                )
                for row in rows
            ],
        )
    with session_scope(settings.resolved_database_url) as session:
        tenant_id = session.scalar(select(Batch.tenant_id).where(Batch.id == batch_id))
        assert tenant_id is not None
        batches_service.cancel(session, settings, tenant_id, batch_id)
        session.info.pop("after_commit", None)
    return batch_id


def _batch_files(settings: Settings, batch_id: str) -> tuple[Batch, list[File]]:
    with session_scope(settings.resolved_database_url) as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        files = session.scalars(
            select(File).where(
                File.tenant_id == batch.tenant_id,
                File.purpose == "batch_output",
                File.deleted.is_(False),
            )
        ).all()
        return batch, list(files)


def _check_one_of_each(settings: Settings, batch_id: str) -> None:
    batch, files = _batch_files(settings, batch_id)
    assert batch.status == "cancelled"
    assert batch.output_file_id is not None and batch.error_file_id is not None
    assert sorted(f.id for f in files) == sorted([batch.output_file_id, batch.error_file_id])
    # And as the user sees it, through the API.
    with session_scope(settings.resolved_database_url) as session:
        key = keys.create_key(session, _tenant_name(session, batch.tenant_id))
    client = TestClient(create_app(settings))
    sdk = OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)
    listed = [f for f in sdk.files.list() if f.purpose == "batch_output"]
    assert sorted(f.id for f in listed) == sorted([batch.output_file_id, batch.error_file_id])
    errors = sdk.files.content(batch.error_file_id).text.splitlines()
    assert [json.loads(e)["custom_id"] for e in errors] == ["r2", "r3"]
    with session_scope(settings.resolved_database_url) as session:
        bills = session.scalar(
            select(func.count()).select_from(LedgerEntry).where(LedgerEntry.batch_id == batch_id)
        )
    assert bills == 1


def _tenant_name(session: Any, tenant_id: str) -> str:
    from storage.models import Tenant

    tenant = session.get(Tenant, tenant_id)
    assert tenant is not None
    return str(tenant.name)


def test_two_racing_finalizes_write_each_file_once(
    any_db_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = any_db_settings
    batch_id = _half_run_cancelled_batch(settings)
    # Both finalizes get past the status check before either writes (on SQLite, which ignores
    # FOR UPDATE, both could): the first to arrive waits up to 3 s for the second. With the batch
    # truly locked, the second cannot arrive, and the first goes on alone after the wait.
    arrived: list[str] = []
    both = threading.Event()
    real = batches_repo.refresh_counts

    def rendezvous(*args: Any, **kwargs: Any) -> None:
        arrived.append(threading.current_thread().name)
        if len(arrived) >= 2:
            both.set()
        both.wait(timeout=3)
        real(*args, **kwargs)

    monkeypatch.setattr(batches_repo, "refresh_counts", rendezvous)
    blobs = get_blob_store(settings.resolved_blob_url)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            assert finalize(settings, blobs, batch_id).done
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=run, name=f"finalize-{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    _check_one_of_each(settings, batch_id)


def test_a_finalize_that_crashed_before_its_commit_then_reran_writes_each_file_once(
    any_db_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    import workers.finalize as finalize_module

    settings = any_db_settings
    batch_id = _half_run_cancelled_batch(settings)
    blobs = get_blob_store(settings.resolved_blob_url)

    class Crash(Exception):
        pass

    class CrashingLog:
        """The files are written and the status set; the process dies before the commit."""

        def info(self, *_args: object) -> None:
            raise Crash

    with monkeypatch.context() as patch:
        patch.setattr(finalize_module, "log", CrashingLog())
        with pytest.raises(Crash):
            finalize(settings, blobs, batch_id)
    assert _status(settings, batch_id) == "cancelling"
    assert finalize(settings, blobs, batch_id).done
    assert finalize(settings, blobs, batch_id).done  # and a late duplicate changes nothing
    _check_one_of_each(settings, batch_id)


def test_the_migration_retires_the_unreferenced_twin_files(tmp_path: Path) -> None:
    """Databases that already hold a second, unreferenced row on an output blob (the bug) still
    migrate: the twin is marked deleted, the referenced file and the bytes stay."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    migrations.upgrade(url, "0005")
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO tenants (id, name, created_at) VALUES ('t', 't', 0)"))
        for file_id in ("file-a", "file-b"):
            connection.execute(
                text(
                    "INSERT INTO files (id, tenant_id, filename, purpose, bytes, status, blob_key,"
                    " created_at, deleted) VALUES (:id, 't', 'b_error.jsonl', 'batch_output', 1,"
                    " 'processed', 'outputs/b/errors.jsonl', 0, false)"
                ),
                {"id": file_id},
            )
        connection.execute(
            text(
                "INSERT INTO batches (id, tenant_id, endpoint, input_file_id, completion_window,"
                " status, error_file_id, created_at, expires_at, total, completed, failed,"
                " input_tokens, cached_tokens, output_tokens) VALUES ('b', 't',"
                " '/v1/chat/completions', 'file-in', '24h', 'cancelled', 'file-b', 0, 0, 0, 0, 0,"
                " 0, 0, 0)"
            )
        )
    migrations.upgrade(url)
    with engine.connect() as connection:
        rows = {
            file_id: bool(deleted)
            for file_id, deleted in connection.execute(text("SELECT id, deleted FROM files"))
        }
    engine.dispose()
    assert rows == {"file-a": True, "file-b": False}
