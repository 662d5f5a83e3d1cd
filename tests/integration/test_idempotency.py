"""Idempotent creates: ``Idempotency-Key`` on ``POST /v1/files`` and
``POST /v1/batches`` with the IETF httpapi draft's semantics, through the official ``openai``
SDK. The SDK itself sends no ``Idempotency-Key`` (openai 3.x generates a retry key, but its
client's ``_idempotency_header`` is ``None``, so the header is never set): a client passes one
with ``extra_headers``, and the SDK's own retries then repeat it."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from sqlalchemy import func, select

from api.app import create_app
from api.services import batches as batches_service
from offpeak.settings import Settings
from storage.db import session_scope
from storage.models import Batch, File, IdempotencyKey, Tenant
from tests.support.batches import line
from tests.support.database import new_key

BODY = b"\n".join(line(f"r{i}") for i in range(3))


class TimesOutOnce(TestClient):
    """The API in-process, but the first answer to ``POST <path>`` is lost after the server has
    handled it: the client sees a read timeout, as when a create's answer never arrives."""

    def __init__(self, app: Any, path: str) -> None:
        super().__init__(app)
        self.path, self.lost = path, 0
        #: The Idempotency-Key of every request to ``path`` (None: the header was not sent).
        self.keys: list[str | None] = []

    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        if request.url.path == self.path:
            self.keys.append(request.headers.get("Idempotency-Key"))
        response = super().send(request, **kwargs)
        if request.method == "POST" and request.url.path == self.path and not self.lost:
            self.lost += 1
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return response


def _client(settings: Settings, http: TestClient, retries: int = 0) -> tuple[OpenAI, str]:
    key = new_key(settings)
    sdk = OpenAI(
        base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=retries
    )
    return sdk, key


def _count(settings: Settings, model: type, key: str) -> int:
    from api.services.keys import tenant_for_key

    with session_scope(settings.resolved_database_url) as session:
        tenant = tenant_for_key(session, key)
        assert tenant is not None
        return int(
            session.scalar(select(func.count()).where(model.tenant_id == tenant.id)) or 0  # type: ignore[attr-defined]
        )


def _create(sdk: OpenAI, file_id: str, key: str | None, **extra: Any):  # type: ignore[no-untyped-def]
    headers = {"Idempotency-Key": key} if key else None
    return sdk.batches.with_raw_response.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_headers=headers,
        **extra,
    )


def test_a_retry_with_the_same_key_and_body_returns_the_same_batch(settings: Settings) -> None:
    sdk, api_key = _client(settings, TestClient(create_app(settings)))
    file = sdk.files.create(file=("in.jsonl", BODY), purpose="batch")
    key = str(uuid.uuid4())
    first = _create(sdk, file.id, key, metadata={"run": "1"})
    again = _create(sdk, file.id, key, metadata={"run": "1"})
    assert (again.status_code, again.content) == (first.status_code, first.content)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert _count(settings, Batch, api_key) == 1
    # The draft's Structured Field form of the same key is the same key.
    quoted = _create(sdk, file.id, f'"{key}"', metadata={"run": "1"})
    assert quoted.parse().id == first.parse().id
    # Without a key, or with another one, a create is a create.
    _create(sdk, file.id, None, metadata={"run": "1"})
    _create(sdk, file.id, str(uuid.uuid4()), metadata={"run": "1"})
    assert _count(settings, Batch, api_key) == 3


def test_the_same_key_with_another_body_is_refused_with_422(settings: Settings) -> None:
    sdk, api_key = _client(settings, TestClient(create_app(settings)))
    file = sdk.files.create(file=("in.jsonl", BODY), purpose="batch")
    key = str(uuid.uuid4())
    _create(sdk, file.id, key, metadata={"run": "1"})
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        _create(sdk, file.id, key, metadata={"run": "2"})
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["message"] == "Idempotency-Key is already used with a different payload."
    assert (error["code"], error["param"], error["type"]) == (
        "idempotency_key_reused",
        "Idempotency-Key",
        "invalid_request_error",
    )
    # Another endpoint is another request (its path is in the fingerprint).
    with pytest.raises(openai.UnprocessableEntityError):
        sdk.files.create(
            file=("in.jsonl", BODY), purpose="batch", extra_headers={"Idempotency-Key": key}
        )
    assert _count(settings, Batch, api_key) == 1


def test_keys_are_per_tenant(settings: Settings) -> None:
    http = TestClient(create_app(settings))
    (a, a_key), (b, b_key) = _client(settings, http), _client(settings, http)
    key = str(uuid.uuid4())
    file_a = a.files.create(file=("in.jsonl", BODY), purpose="batch")
    file_b = b.files.create(file=("in.jsonl", BODY), purpose="batch")
    assert _create(a, file_a.id, key).parse().id != _create(b, file_b.id, key).parse().id
    assert (_count(settings, Batch, a_key), _count(settings, Batch, b_key)) == (1, 1)


def test_a_retry_while_the_first_request_runs_gets_409(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first create is held inside the service (the test holds it: only the timing is
    faked); a retry meanwhile is refused with 409, and once the first has answered the retry
    gets its answer."""
    sdk, api_key = _client(settings, TestClient(create_app(settings)))
    file = sdk.files.create(file=("in.jsonl", BODY), purpose="batch")
    entered, release = threading.Event(), threading.Event()
    real_create = batches_service.create

    def held_create(*args: Any, **kwargs: Any) -> Batch:
        entered.set()
        assert release.wait(30)
        return real_create(*args, **kwargs)

    monkeypatch.setattr(batches_service, "create", held_create)
    key = str(uuid.uuid4())
    answers: list[Any] = []
    first = threading.Thread(target=lambda: answers.append(_create(sdk, file.id, key)))
    first.start()
    try:
        assert entered.wait(30)
        with pytest.raises(openai.ConflictError) as busy:
            _create(sdk, file.id, key)
        assert isinstance(busy.value.body, dict)
        assert busy.value.body["code"] == "idempotency_key_in_flight"
    finally:
        release.set()
        first.join(30)
    monkeypatch.setattr(batches_service, "create", real_create)
    (answer,) = answers
    assert _create(sdk, file.id, key).content == answer.content
    assert _count(settings, Batch, api_key) == 1


def test_a_failed_first_request_releases_its_key(settings: Settings) -> None:
    sdk, api_key = _client(settings, TestClient(create_app(settings)))
    file = sdk.files.create(file=("in.jsonl", BODY), purpose="batch")
    key = str(uuid.uuid4())
    with pytest.raises(openai.BadRequestError):
        _create(sdk, file.id, key, metadata={"x" * 100: "too long a key"})
    ok = _create(sdk, file.id, key)  # fixed body, same key: runs, no 422
    assert ok.status_code == 200
    assert _count(settings, Batch, api_key) == 1


def test_a_key_whose_first_request_died_is_taken_over(settings: Settings) -> None:
    sdk, api_key = _client(settings, TestClient(create_app(settings)))
    file = sdk.files.create(file=("in.jsonl", BODY), purpose="batch")
    key = str(uuid.uuid4())
    with session_scope(settings.resolved_database_url) as session:
        from api.services.keys import tenant_for_key

        tenant = tenant_for_key(session, api_key)
        assert isinstance(tenant, Tenant)
        at = time.time()
        session.add(  # a reservation whose process died: in flight, its lock run out
            IdempotencyKey(
                tenant_id=tenant.id,
                key=key,
                fingerprint="0" * 64,
                state="in_flight",
                created_at=at - 120,
                locked_until=at - 60,
                expires_at=at + 3600,
            )
        )
    assert _create(sdk, file.id, key).status_code == 200
    assert _create(sdk, file.id, key).headers["Idempotent-Replayed"] == "true"
    assert _count(settings, Batch, api_key) == 1


def test_a_malformed_key_is_a_400(settings: Settings) -> None:
    sdk, _ = _client(settings, TestClient(create_app(settings)))
    file = sdk.files.create(file=("in.jsonl", BODY), purpose="batch")
    for bad in ("", "x" * 256):
        with pytest.raises(openai.BadRequestError) as refused:
            _create(sdk, file.id, bad or '""')
        assert isinstance(refused.value.body, dict)
        assert refused.value.body["code"] == "invalid_idempotency_key"


@pytest.mark.parametrize("with_key", [True, False])
def test_a_create_whose_answer_timed_out_is_retried_by_the_sdk_without_a_second_batch(
    settings: Settings, with_key: bool
) -> None:
    """The first answer is lost after the batch was made; the SDK retries (``max_retries=2``)
    with the same headers. With a key: one batch, and the retry's answer is the first's.
    Without one (the control): two batches, which the tenant would be billed for twice."""
    http = TimesOutOnce(create_app(settings), "/v1/batches")
    sdk, api_key = _client(settings, http, retries=2)
    file = sdk.files.create(file=("in.jsonl", BODY), purpose="batch")
    before = _count(settings, Batch, api_key)
    headers = {"Idempotency-Key": str(uuid.uuid4())} if with_key else None
    batch = sdk.batches.with_raw_response.create(
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_headers=headers,
    )
    assert http.lost == 1
    after = _count(settings, Batch, api_key)
    # The SDK's retry repeats the caller's key; it sends none of its own.
    sent = headers["Idempotency-Key"] if headers else None
    assert http.keys == [sent, sent]
    if with_key:
        assert after - before == 1
        assert batch.headers["Idempotent-Replayed"] == "true"
        with session_scope(settings.resolved_database_url) as session:
            assert session.get(Batch, batch.parse().id) is not None
    else:
        assert after - before == 2


def test_an_upload_retried_by_the_sdk_after_a_timeout_stores_one_file(settings: Settings) -> None:
    """The SDK's retry builds a new multipart body (a new boundary): the fingerprint is the
    file's bytes and fields, so it is still the same request."""
    http = TimesOutOnce(create_app(settings), "/v1/files")
    sdk, api_key = _client(settings, http, retries=2)
    key = str(uuid.uuid4())
    file = sdk.files.create(
        file=("in.jsonl", BODY), purpose="batch", extra_headers={"Idempotency-Key": key}
    )
    assert http.lost == 1 and _count(settings, File, api_key) == 1
    assert sdk.files.retrieve(file.id).bytes == len(BODY)
    with pytest.raises(openai.UnprocessableEntityError):  # other bytes, same key
        sdk.files.create(
            file=("in.jsonl", BODY + b"\n"), purpose="batch", extra_headers={"Idempotency-Key": key}
        )


def test_racing_creates_with_one_key_make_one_batch(settings: Settings) -> None:
    """Eight clients send the same create with the same key at once: one reservation wins (the
    insert's ``ON CONFLICT DO NOTHING``); the others get its answer or a 409, never a second
    batch."""
    http = TestClient(create_app(settings))
    sdk, api_key = _client(settings, http)
    file = sdk.files.create(file=("in.jsonl", BODY), purpose="batch")
    key, start = str(uuid.uuid4()), threading.Barrier(8)
    answers: list[tuple[int, bytes]] = []

    def create() -> None:
        start.wait()
        try:
            raw = _create(sdk, file.id, key)
            answers.append((raw.status_code, raw.content))
        except openai.ConflictError:
            answers.append((409, b""))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(answers) == 8
    bodies = {body for status, body in answers if status == 200}
    assert len(bodies) == 1 and {s for s, _ in answers} <= {200, 409}
    assert _count(settings, Batch, api_key) == 1
