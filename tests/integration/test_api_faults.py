"""Faults at the API's edges, each injected for real: lone UTF-16 surrogates in JSON bodies,
overlapping writers of one scheduler switch, a method a path does not serve, a broker that is
down after a batch committed, and a cancel while validation copies the batch's rows in."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis
from fastapi.testclient import TestClient
from openai import OpenAI
from sqlalchemy import func, select

from api.app import create_app
from offpeak import celery_app
from offpeak.settings import Settings
from storage.blobs import BlobStore, get_blob_store
from storage.db import get_sessionmaker, session_scope
from storage.models import Batch, RequestLine
from storage.repositories import batches as batches_repo
from storage.repositories import intake as intake_repo
from storage.repositories import scheduler as scheduler_repo
from tests.support.database import fresh_database, new_key

LINE = (
    b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": '
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}}\n'
)
ADMIN_KEY = "sk-admin-faults"


def upload(sdk: OpenAI, data: bytes = LINE) -> str:
    return sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def openai_error(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.fixture(scope="module")
def admin_http(settings: Settings) -> Iterator[TestClient]:
    """The in-process API with the admin API on."""
    with TestClient(create_app(settings.model_copy(update={"admin_api_key": ADMIN_KEY}))) as c:
        yield c


# --- Lone surrogates ----------------------------------------------------------------------------

SURROGATE = "\\ud800"  # as JSON spells it; json.loads makes a str no UTF-8 encoder accepts


@pytest.mark.parametrize(
    ("template", "param"),
    [
        ('{"input_file_id": "%s", "endpoint": "/v1/chat/completions", '
         '"completion_window": "24h"}', "input_file_id"),
        ('{"input_file_id": "FILE", "endpoint": "/v1/chat/completions", '
         '"completion_window": "24h", "metadata": {"team": "a%sb"}}', "metadata.team"),
        ('{"input_file_id": "FILE", "endpoint": "/v1/chat/completions", '
         '"completion_window": "24h", "metadata": {"%s": "v"}}', "metadata.\\ud800"),
        ('{"input_file_id": "FILE", "endpoint": "/v1/chat/completions", '
         '"completion_window": "%s"}', "completion_window"),
        ('{"input_file_id": "FILE", "endpoint": "/v1/chat/completions", '
         '"completion_window": "24h", "output_expires_after": {"anchor": ["%s"]}}',
         "output_expires_after.anchor.0"),
    ],
)  # fmt: skip
def test_lone_surrogate_in_batch_create_is_400(
    http: TestClient, sdk: OpenAI, api_key: str, template: str, param: str
) -> None:
    body = (template % SURROGATE).replace("FILE", upload(sdk))
    response = http.post(
        "/v1/batches",
        content=body.encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400, response.text
    error = openai_error(response)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    assert error["param"] == param and "surrogate" in error["message"]
    assert sdk.batches.list().data == []


def test_lone_surrogate_as_raw_bytes_is_400(http: TestClient, api_key: str) -> None:
    # ED A0 80 is how a surrogate would be "UTF-8"-encoded; json.loads(bytes) lets it through.
    body = b'{"input_file_id": "\xed\xa0\x80", "endpoint": "/v1/chat/completions", ' \
        b'"completion_window": "24h"}'  # fmt: skip
    response = http.post(
        "/v1/batches",
        content=body,
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400 and openai_error(response)["param"] == "input_file_id"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/admin/scheduler/pause", {"pool": SURROGATE}, "pool"),
        ("/v1/admin/scheduler/pause", {"pool": "p", "reason": SURROGATE}, "reason"),
        ("/v1/admin/scheduler/resume", {"pool": SURROGATE}, "pool"),
    ],
)
def test_lone_surrogate_in_admin_calls_is_400(
    admin_http: TestClient, path: str, body: dict[str, str], param: str
) -> None:
    raw = json.dumps(body).replace("\\\\ud800", "\\ud800")  # undo json.dumps' escaping of "\"
    response = admin_http.post(
        path,
        content=raw.encode(),
        headers={"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400, response.text
    assert openai_error(response)["param"] == param


def test_unencodable_value_reaching_the_database_is_400(
    http: TestClient, api_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The net under the body check: a surrogate that reaches the driver by another way (here
    planted in the query string after Starlette decoded it) is still the client's 400."""
    from starlette.requests import Request

    real = Request.query_params.fget  # type: ignore[attr-defined]

    def planted(self: Request) -> Any:
        params = real(self)
        if "after" in params:
            from starlette.datastructures import QueryParams

            return QueryParams({"after": "\ud800"})
        return params

    monkeypatch.setattr(Request, "query_params", property(planted))
    response = http.get("/v1/batches?after=x", headers={"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 400, response.text
    assert openai_error(response)["code"] == "invalid_value"


# --- Overlapping writers of one scheduler switch ------------------------------------------------


def test_concurrent_pause_and_resume_never_fail(admin_http: TestClient) -> None:
    """Pause and resume calls on one pool, overlapping from many threads: every one is a 200."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    pool = f"race-{time.time_ns()}"
    pairs, rounds = 10, 5
    statuses: list[int] = []
    lock = threading.Lock()

    def call(path: str, body: dict[str, object], barrier: threading.Barrier) -> None:
        barrier.wait()
        response = admin_http.post(path, json=body, headers=headers)
        with lock:
            statuses.append(response.status_code)

    for _ in range(rounds):
        barrier = threading.Barrier(2 * pairs)
        threads = [
            threading.Thread(target=call, args=(path, body, barrier))
            for _ in range(pairs)
            for path, body in (
                ("/v1/admin/scheduler/pause", {"pool": pool, "reason": "race"}),
                ("/v1/admin/scheduler/resume", {"pool": pool}),
            )
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert statuses == [200] * (2 * pairs * rounds)
    admin_http.post("/v1/admin/scheduler/resume", json={"pool": pool}, headers=headers)


def backend_pid(session: Any) -> int:
    return int(session.scalar(select(func.pg_backend_pid())))


def wait_until_blocked(database_url: str, pid: int, done: Callable[[], bool]) -> bool:
    """Poll until backend ``pid`` waits for a lock (``True``) or ``done()`` holds (``False``)."""
    dsn = database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not done():
            row = conn.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            if row is not None and row[0] == "Lock":
                return True
            time.sleep(0.01)
    return False


@pytest.mark.parametrize("first", ["put", "delete"])
def test_put_state_waits_for_a_concurrent_writer_instead_of_failing(
    settings: Settings, first: str
) -> None:
    """A second writer of a key whose first writer has not committed yet (an insert, or a
    resume's delete) waits for it, then wins: no unique violation, no update of a deleted row."""
    url = settings.resolved_database_url
    key = f"paused:overlap-{first}-{time.time_ns()}"
    with session_scope(url) as session:
        scheduler_repo.put_state(session, key, {"paused": True, "n": 0}, 1.0)
    if first == "put":
        with session_scope(url) as session:
            scheduler_repo.delete_state(session, key)
    outcome: list[object] = []
    pid: list[int] = []
    started = threading.Event()

    def second_writer() -> None:
        try:
            with session_scope(url) as session:
                pid.append(backend_pid(session))
                started.set()
                scheduler_repo.put_state(session, key, {"paused": True, "n": 2}, 2.0)
            outcome.append("ok")
        except Exception as exc:  # the old read-then-write failed here
            outcome.append(exc)
        finally:
            started.set()

    with session_scope(url) as session:
        if first == "put":
            scheduler_repo.put_state(session, key, {"paused": True, "n": 1}, 1.5)
        else:
            scheduler_repo.delete_state(session, key)
        thread = threading.Thread(target=second_writer)
        thread.start()
        started.wait()
        # Commit the first writer only once the second one waits on it.
        wait_until_blocked(url, pid[0], lambda: bool(outcome))
    thread.join()
    assert outcome == ["ok"], outcome
    with session_scope(url) as session:
        assert scheduler_repo.get_states(session, [key]) == {key: {"paused": True, "n": 2}}
        scheduler_repo.delete_state(session, key)


# --- 405 ------------------------------------------------------------------------------------------


def test_405_says_which_methods_are_allowed(http: TestClient, api_key: str) -> None:
    response = http.put("/v1/batches", headers={"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 405
    assert {m.strip() for m in response.headers["allow"].split(",")} == {"GET", "POST"}
    assert openai_error(response)["code"] == "method_not_allowed"
    response = http.delete("/v1/batches/batch_x/cancel")
    assert response.status_code == 405 and response.headers["allow"] == "POST"


# --- A broker that is down after the batch committed --------------------------------------------

DEAD_BROKER = "redis://127.0.0.1:1/0"  # nothing listens on port 1: every send is refused


@pytest.fixture(scope="module")
def own_settings(settings: Settings, run_id: str) -> Iterator[Settings]:
    """Settings on a database of this module's own (its sweep and lock checks see only this
    module's batches and backends) and a queue prefix nobody consumes."""
    with fresh_database(f"offpeak_{run_id}_apifaults") as url:
        yield settings.model_copy(
            update={"database_url": url, "queue_prefix": f"{run_id}-apifaults"}
        )


def own_sdk(http: TestClient, settings: Settings) -> OpenAI:
    return OpenAI(
        base_url="http://testserver/v1", api_key=new_key(settings), http_client=http, max_retries=0
    )


def queued(settings: Settings, task: str) -> list[str]:
    """The argument lists (as Celery's ``argsrepr``) of ``task`` messages queued in Redis."""
    client = redis.Redis.from_url(settings.resolved_broker_url)
    found = []
    for raw in client.lrange(celery_app.control_queue(settings), 0, -1):
        headers = json.loads(raw)["headers"]
        if headers["task"] == task:
            found.append(headers["argsrepr"])
    return found


def batch_rows(settings: Settings, tenant_file: str) -> int:
    with session_scope(settings.resolved_database_url) as session:
        query = select(func.count()).select_from(Batch).where(Batch.input_file_id == tenant_file)
        return int(session.scalar(query) or 0)


def test_broker_down_after_commit_still_answers_and_the_sweep_resends(
    own_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Create and cancel with the broker down: both answer 200 (the rows committed; a 500 would
    make the client retry and create the batch twice), and the sweep sends what is owed."""
    dead = own_settings.model_copy(update={"broker_url": DEAD_BROKER})
    with TestClient(create_app(dead), raise_server_exceptions=False) as http:
        sdk = own_sdk(http, dead)
        file_id = upload(sdk)
        batch = sdk.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.status == "validating"
        other = sdk.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert sdk.batches.cancel(other.id).status == "cancelling"
        assert {b.id for b in sdk.batches.list()} == {batch.id, other.id}
    assert batch_rows(own_settings, file_id) == 2  # each created once

    from workers import tasks

    client = redis.Redis.from_url(own_settings.resolved_broker_url)
    client.delete(celery_app.control_queue(own_settings))
    monkeypatch.setattr(tasks, "get_settings", lambda: own_settings)
    try:
        tasks.sweep()
        assert repr([batch.id]) in queued(own_settings, celery_app.VALIDATE_TASK)
        assert repr([other.id]) in queued(own_settings, celery_app.FINALIZE_TASK)
    finally:
        client.delete(celery_app.control_queue(own_settings))


# --- Cancel while validation copies the rows in -------------------------------------------------


class GatedBlobs:
    """A blob store whose reads stop after the first piece of a file until ``gate`` is set,
    so a validation holds its transaction open mid-``COPY`` for as long as the test wants."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.reached, self.gate = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def iter_chunks(self, key: str) -> Iterator[bytes]:
        for number, chunk in enumerate(self.inner.iter_chunks(key)):
            yield chunk
            if number == 1:  # a whole piece's rows went to the COPY already
                self.reached.set()
                self.gate.wait()


def lock_waiters(settings: Settings) -> int:
    """Backends of this module's database that wait for a lock."""
    dsn = settings.resolved_database_url.replace("postgresql+psycopg://", "postgresql://")
    name = dsn.rsplit("/", 1)[1]
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
            (name,),
        ).fetchone()
    return int(row[0]) if row else 0


def waits_for_a_lock(settings: Settings, call: threading.Thread) -> bool:
    """Whether ``call`` (started) ends up waiting for a lock before it finishes."""
    while call.is_alive():
        if lock_waiters(settings):
            return True
        time.sleep(0.01)
    return False


def many_lines(count: int) -> bytes:
    return b"".join(LINE.replace(b'"a"', b'"line-%d"' % i) for i in range(count))


def cancel_in_thread(sdk: OpenAI, batch_id: str, answers: list[Any]) -> threading.Thread:
    thread = threading.Thread(target=lambda: answers.append(sdk.batches.cancel(batch_id)))
    thread.start()
    return thread


@pytest.mark.parametrize("finalize_first", [False, True])
def test_cancel_during_validation_answers_at_once_and_the_batch_ends_cancelled(
    own_settings: Settings, finalize_first: bool
) -> None:
    """A validation mid-``COPY`` holds its transaction open; a cancel answers ``cancelling``
    without waiting for it, validation then drops its rows instead of starting the batch, and
    finalize ends it ``cancelled`` (before or after validation lets go)."""
    from workers.finalize import finalize
    from workers.validation import run_validation

    blobs = GatedBlobs(get_blob_store(own_settings.resolved_blob_url))
    with TestClient(create_app(own_settings)) as http:
        sdk = own_sdk(http, own_settings)
        data = many_lines(20_000)  # ~3 MiB: several 1 MiB pieces
        batch = sdk.batches.create(
            input_file_id=upload(sdk, data),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        validated: list[str | None] = []
        validation = threading.Thread(
            target=lambda: validated.append(run_validation(own_settings, blobs, batch.id))
        )
        validation.start()
        try:
            assert blobs.reached.wait(timeout=120), "validation never got to its second piece"
            # The sweep re-sends validations: a second one skips at once, without waiting.
            assert run_validation(own_settings, blobs.inner, batch.id) is None
            answers: list[Any] = []
            cancel = cancel_in_thread(sdk, batch.id, answers)
            blocked = waits_for_a_lock(own_settings, cancel)
            if not finalize_first:
                blobs.gate.set()
            if blocked:
                blobs.gate.set()
            cancel.join()
            assert not blocked, "the cancel waited for validation's lock"
            assert answers[0].status == "cancelling" and answers[0].cancelling_at is not None
            if finalize_first:
                assert finalize(own_settings, blobs.inner, batch.id).done
                blobs.gate.set()
        finally:
            blobs.gate.set()
            validation.join()
        assert validated == [None]  # not started: no drain is sent
        if not finalize_first:
            for _ in range(3):
                if finalize(own_settings, blobs.inner, batch.id).done:
                    break
        ended = sdk.batches.retrieve(batch.id)
    assert ended.status == "cancelled" and ended.cancelled_at is not None
    assert ended.request_counts.total == 0
    with session_scope(own_settings.resolved_database_url) as session:
        rows = select(func.count()).select_from(RequestLine)
        assert session.scalar(rows.where(RequestLine.batch_id == batch.id)) == 0


def test_cancel_does_not_wait_for_a_transaction_inserting_the_batch_rows(
    own_settings: Settings,
) -> None:
    """Inserting request rows locks their batch row ``FOR KEY SHARE`` (the foreign key) until
    the transaction ends, as validation's ``COPY`` does: a cancel must not wait for it."""
    with TestClient(create_app(own_settings)) as http:
        sdk = own_sdk(http, own_settings)
        batch = sdk.batches.create(
            input_file_id=upload(sdk), endpoint="/v1/chat/completions", completion_window="24h"
        )
        inserting = get_sessionmaker(own_settings.resolved_database_url)()
        try:
            row = batches_repo.get_any(inserting, batch.id)
            assert row is not None
            line = LINE.decode().strip()
            intake_repo.bulk_insert(
                inserting, [(batch.id, 1, "a", "SmolLM2-135M-Instruct", row.expires_at, line, 0)]
            )
            answers: list[Any] = []
            cancel = cancel_in_thread(sdk, batch.id, answers)
            blocked = waits_for_a_lock(own_settings, cancel)
        finally:
            inserting.rollback()
            inserting.close()
        cancel.join()
        assert not blocked, "the cancel waited for the inserting transaction"
        assert answers[0].status == "cancelling"


# --- The OpenAPI document -------------------------------------------------------------------------


def test_openapi_declares_what_each_route_answers(http: TestClient) -> None:
    document = http.get("/openapi.json").json()
    paths = document["paths"]

    def statuses(path: str, method: str) -> set[str]:
        return set(paths[path][method]["responses"])

    # 409 and 422 on the creates: an Idempotency-Key in flight, or reused with another body.
    # 503 on every /v1 route: the database is unavailable (tests/integration/test_api_db_outage.py);
    # 429 on every tenant's route: too many wrong keys from one address (``api.key_gate``).
    assert statuses("/v1/batches", "post") == {
        "200", "400", "401", "404", "409", "413", "422", "429", "503"
    }  # fmt: skip
    assert statuses("/v1/batches/{batch_id}/cancel", "post") == {
        "200", "400", "401", "404", "409", "413", "429", "503"
    }  # fmt: skip
    assert statuses("/v1/files", "post") == {
        "200", "400", "401", "409", "413", "422", "429", "503"
    }  # fmt: skip
    assert statuses("/v1/files/{file_id}", "get") == {"200", "400", "401", "404", "429", "503"}
    assert statuses("/v1/models", "get") == {"200", "401", "429", "503"}
    assert set(paths["/v1/models"]["get"]["responses"]["503"]["headers"]) == {"Retry-After"}
    assert set(paths["/v1/models"]["get"]["responses"]["429"]["headers"]) == {"Retry-After"}
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    # Anthropic's surface answers errors in Anthropic's shape (``api.errors``).
    anthropic_error = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
    for path, operations in paths.items():
        expected = anthropic_error if path.startswith("/v1/messages") else error
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")):
                    assert response["content"]["application/json"]["schema"] == expected, (
                        method, path, status
                    )  # fmt: skip
            if path.startswith("/v1/"):
                assert {"401", "503"} <= set(operation["responses"]), (method, path)
                schemes = (
                    ([{"XApiKey": []}, {"ApiKey": []}],)  # Anthropic's x-api-key, or a bearer
                    if path.startswith("/v1/messages")
                    else ([{"ApiKey": []}], [{"AdminKey": []}])
                )
                assert operation["security"] in schemes, (method, path)
    content = paths["/v1/files/{file_id}/content"]["get"]["responses"]["200"]["content"]
    assert set(content) == {"application/octet-stream"}
    assert "HTTPValidationError" not in str(document)  # FastAPI's 422 body is never sent
